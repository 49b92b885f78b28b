"""What FlashInfer computes, as its one declaration (``mstar_flashinfer.plugin.FLASHINFER``) says:
the head dims and dtypes. The registry enforces them at selection; a wrapper built through its
loose constructor (not ``from_size``) checks them here, against that same declaration.

Only CUDA runs FlashInfer, so on any other device (CPU tests driving the wrappers through a
stand-in module, with toy head dims and float32) nothing is checked.
"""

from __future__ import annotations

import torch

from mstar_core.plugin import InputError
from mstar_flashinfer.plugin import FLASHINFER

# The declared head dims (FlashInfer 0.5.3's kernels exist for these alone).
SUPPORTED_HEAD_DIMS: tuple[int, ...] = FLASHINFER.head_dims.values or ()
# The declared dtypes (its attention kernels take 16-bit queries and K/V).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(FLASHINFER.dtypes)


def _on_cuda(device: torch.device | str | None) -> bool:
    return device is None or torch.device(device).type == "cuda"


def check_flashinfer_head_dim(head_dim: int, device: torch.device | str | None = None) -> None:
    """Raise unless FlashInfer's paged attention computes ``head_dim`` exactly.

    Only CUDA runs FlashInfer, so a non-CUDA ``device`` (CPU tests driving the wrappers through a
    stand-in module, with toy head dims) is not checked; ``None`` means CUDA.
    """
    if _on_cuda(device) and FLASHINFER.head_dims.refusal(head_dim):
        raise InputError(
            f"FlashInfer cannot compute head_dim={head_dim}: its paged attention kernels exist for "
            f"head_dim in {SUPPORTED_HEAD_DIMS}"
        )


def check_flashinfer_dtype(dtype: torch.dtype, device: torch.device | str | None = None) -> None:
    """Raise unless FlashInfer computes in ``dtype`` (on CUDA; ``None`` means CUDA)."""
    if _on_cuda(device) and dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise InputError(f"FlashInfer cannot compute in {dtype}: its attention kernels take {names}")
