"""FP8 KV storage: ``stored = x / scale`` on write, ``stored * scale`` on read."""

from __future__ import annotations

import math

import torch

# The FP8 formats that can hold ±inf (e4m3fn cannot: its top code is NaN).
_HAS_INF = frozenset({torch.float8_e5m2})


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in FP8 ``dtype``: a finite value saturated at the format's largest finite
    value (a plain cast turns an out-of-range value into NaN for e4m3fn); a non-finite one stays
    non-finite, as in a model-dtype cache: NaN stays NaN, ±inf stays ±inf in e5m2 and becomes
    NaN in e4m3fn (which has no inf), never a plausible finite value."""
    top = torch.finfo(dtype).max
    y = x.float() / scale
    # The mask is taken on x: a finite x whose quotient overflows float32 still saturates. Where
    # the format has no inf, NaN is written: torch's cast would saturate inf to the largest value.
    finite = torch.isfinite(x)
    if dtype in _HAS_INF:
        return torch.where(finite, y.clamp(-top, top), y).to(dtype)
    return torch.where(finite, y.clamp(-top, top), math.nan).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``dtype`` (what a kernel reads from FP8 storage)."""
    return (x.to(torch.float32) * scale).to(dtype) if x.dtype != dtype or scale != 1.0 else x
