"""Build-time checks: what FlashInfer 0.5.3 can run, refused with an error naming what it can.

Only CUDA runs FlashInfer; on any other device (CPU tests through a stand-in module) the dtype and
head-dim checks are skipped so the wrappers can be driven in float32.
"""

from __future__ import annotations

import torch

from .head_dim import check_flashinfer_head_dim

# The attention kernels take 16-bit queries and K/V (prefill.cuh: static_assert sizeof == 2).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    if is_cuda(device) and dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"FlashInfer cannot compute in {dtype}: its attention kernels take {names}")


def check_page_size(page_size: int) -> None:
    # Any positive page size is a kernel parameter, not a compiled variant; zero or a float is a bug.
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be a positive int (FlashInfer takes any page size >= 1), got {page_size!r}")


def check_geometry(num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    check_flashinfer_head_dim(head_dim, device)


def require(name: str, value: int | None, why: str) -> int:
    """A constructor argument that graph mode needs: static buffers are sized from it."""
    if value is None or value < 1:
        raise ValueError(f"{name} is required {why} (static buffers are sized from it), got {value!r}")
    return int(value)
