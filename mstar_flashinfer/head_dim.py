"""Which head dims FlashInfer's paged attention computes exactly.

FlashInfer 0.5.3 compiles one kernel per head dim, and only some of them exist: the sm90 (fa3)
kernels static_assert ``HEAD_DIM in (64, 128, 256)`` and the fa2 dispatch covers the same dims
(plus 512, which the sm90 path and the tensor-core decode cannot run). Any other head dim fails
at JIT-compile time on the GPU, or is not a FlashInfer kernel at all: refuse it when the backend
is built instead.
"""

from __future__ import annotations

import torch

from mstar_core.plugin import InputError

SUPPORTED_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)


def check_flashinfer_head_dim(head_dim: int, device: torch.device | str | None = None) -> None:
    """Raise unless FlashInfer's paged attention computes ``head_dim`` exactly.

    Only CUDA runs FlashInfer, so a non-CUDA ``device`` (CPU tests driving the wrappers through a
    stand-in module, with toy head dims) is not checked; ``None`` means CUDA.
    """
    if device is not None and torch.device(device).type != "cuda":
        return
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise InputError(
            f"FlashInfer cannot compute head_dim={head_dim}: its paged attention kernels exist for "
            f"head_dim in {SUPPORTED_HEAD_DIMS}"
        )
