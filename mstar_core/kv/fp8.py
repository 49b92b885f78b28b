"""FP8 KV storage: ``stored = x / scale`` on write, ``stored * scale`` on read."""

from __future__ import annotations

import torch


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in FP8 ``dtype``, saturated at its largest finite value (a plain cast turns
    an out-of-range value into NaN for e4m3fn); NaN stays NaN."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``dtype`` (what a kernel reads from FP8 storage)."""
    return (x.to(torch.float32) * scale).to(dtype) if x.dtype != dtype or scale != 1.0 else x
