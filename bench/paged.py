"""The paged problems the FlashInfer benchmarks share: the head shape, the page-table arrays of
a batch, a cache of random pages and a workspace. bf16, 32 query heads, 8 KV heads, head dim
128, page size 16."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate

import torch

HQ, HKV, D, PS = 32, 8, 128, 16
BF16 = torch.bfloat16
DEV = torch.device("cuda")


def paged_layout(q_lens: Sequence[int], kv_lens: Sequence[int], seed: int = 0) -> dict:
    """Host int32 page-table arrays for one request per ``(q_len, kv_len)``, its pages shuffled
    (a cache in use is not contiguous); ``pages``: how many the batch holds."""
    pages = [math.ceil(n / PS) for n in kv_lens]
    total = sum(pages)
    i32 = dict(dtype=torch.int32)
    return dict(
        qo_indptr=torch.tensor([0, *accumulate(q_lens)], **i32),
        kv_indptr=torch.tensor([0, *accumulate(pages)], **i32),
        kv_indices=torch.randperm(total, generator=torch.Generator().manual_seed(seed)).to(torch.int32),
        last=torch.tensor([n - (p - 1) * PS for n, p in zip(kv_lens, pages, strict=False)], **i32),
        kv_lens=torch.tensor(list(kv_lens), **i32),
        pages=total,
    )


def uniform_layout(rows: int, kv_len: int, q_len: int) -> dict:
    """``rows`` requests of ``kv_len`` keys and ``q_len`` queries each."""
    return paged_layout([q_len] * rows, [kv_len] * rows)


def random_cache(pages: int, seed: int) -> torch.Tensor:
    """``[pages, 2, PS, HKV, D]`` bf16 of random values (never zeros: they can run faster)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(pages, 2, PS, HKV, D, device=DEV, dtype=BF16, generator=g)


def workspace() -> torch.Tensor:
    return torch.empty(128 << 20, dtype=torch.uint8, device=DEV)

