"""Small builders shared by the FlashInfer plugin's CPU tests."""

from __future__ import annotations

import torch

from mstar_core.testing import conformance as C


def case(q_lens, prefix_lens, page_size=4, head_dim=16, gqa=2, causal=True, seed=0, window_left=-1):
    return C.PagedCase(page_size, head_dim, gqa, tuple(q_lens), tuple(prefix_lens), causal=causal, seed=seed,
                       window_left=window_left)


def oracle(c: C.PagedCase, data: C.PagedData) -> torch.Tensor:
    return C.paged_oracle(c, data, c.causal)


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    from mstar_core.testing.oracle import rel_error

    return rel_error(out, ref)


def shifted(data: C.PagedData, pages_extra: int) -> C.PagedData:
    """The same case with every page id moved up by ``pages_extra`` (page 0.. left to the caller,
    e.g. as a poisoned sink page)."""
    layer = torch.cat([torch.full((pages_extra, *data.layer.shape[1:]), 1e4, dtype=data.layer.dtype), data.layer])
    return C.PagedData(data.q, layer, data.qo_indptr, data.kv_indptr, data.kv_indices + pages_extra,
                       data.last_page_len, data.kv_lens, data.keys)
