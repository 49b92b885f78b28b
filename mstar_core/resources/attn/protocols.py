"""What a backend's wrappers implement. The paged ones have seed 001's FlashInfer shapes; the
prefixed ragged one is the dense path's (seed 000): query = fresh tokens, keys = [prefix | fresh].

Index arrays may be host tensors: that is preferred (FlashInfer's own ``plan`` reads them on the
host, and a device tensor there forces a synchronisation). The one exception is the paged
``paged_kv_indices``: the paged KV manager passes it as an int32 tensor on the cache's device
(gathered there from its page table, so a plan's host work does not grow with the context), and
the host arrays beside it; only the mixed wrapper gets host page indices (its split is host
arithmetic). A paged wrapper must accept either.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class PagedPrefillWrapper(Protocol):
    """Batched prefill over a paged layer view; ``run(q [tokens, Hq, D], layer) -> [tokens, Hq, D]``.

    Constructor: ``(workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size,
    batch_size=None, max_total_tokens=None, max_num_pages=None, device=..., accelerator_graph=False,
    enable_nvtx=False, backend='auto')``.
    """

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: torch.Tensor | None = None,
        window_left: int = -1,
        **kwargs: Any,
    ) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class PagedDecodeWrapper(Protocol):
    """Batched one-token decode; ``run(q [rows, Hq, D], layer) -> [rows, Hq, D]``.

    Constructor: ``(workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size,
    batch_size=None, max_num_pages=None, device=..., accelerator_graph=False, enable_nvtx=False,
    backend='auto')``.
    """

    def plan(
        self,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: torch.Tensor | None = None,
        window_left: int = -1,
        **kwargs: Any,
    ) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class MixedWrapper(Protocol):
    """A step mixing one-token rows with prompt rows. Constructor: ``(decode_workspace,
    prefill_workspace, num_qo_heads, num_kv_heads, head_dim, page_size, batch_size,
    max_total_tokens, max_num_pages, max_prefill_rows, device, backend='auto')``; ``plan`` and
    ``run`` as the prefill wrapper's."""

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: torch.Tensor | None = None,
        window_left: int = -1,
        **kwargs: Any,
    ) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class PrefixedPrefillWrapper(Protocol):
    """One varlen pass: segment i's queries ``q[cu_q[i]:cu_q[i+1]]`` attend keys
    ``k[cu_k[i]:cu_k[i+1]]`` = [frozen prefix | fresh], causal masks aligned bottom-right.

    Constructor: ``(num_qo_heads, num_kv_heads, head_dim, device, workspace_buffer=None,
    backend='auto')``.
    """

    def plan(
        self,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        sm_scale: float | None = None,
        window_left: int = -1,
    ) -> None: ...

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...
