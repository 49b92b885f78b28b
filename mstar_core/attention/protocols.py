"""What a backend's wrappers implement: the plugin contract's code half (docs/PLUGINS.md is
the other; ``mstar check NAME`` tests a backend against both). The paged wrappers have
FlashInfer's shapes; the prefixed ragged one is the dense path's: query = fresh
tokens, keys = [prefix | fresh].

Shared by every wrapper:

- **Rows and positions.** A plan describes rows (requests); row i's queries are the last
  ``q_len`` of its ``kv_len`` positions, so query j sits at position ``kv_len - q_len + j``
  (bottom-right alignment). ``causal``: it sees keys at positions ``<= its own``;
  ``window_left >= 0``: also only keys at positions ``>= its own - window_left`` (-1: no
  window). Rows never see each other's keys.
- **GQA.** ``num_qo_heads`` is a multiple of ``num_kv_heads``; query head h reads KV head
  ``h // (num_qo_heads // num_kv_heads)``.
- **Scores.** ``q . k * sm_scale`` (None: ``1 / sqrt(head_dim)``); with the ``soft_cap`` feature
  (``logits_soft_cap=c``) then ``c * tanh(score / c)``; softmax over the keys a query sees (with
  ``sink_logits``: ``exp(sinks[h])`` joins the denominator).
- **Queries that see no key** (a row with fewer keys than queries, under causal masking)
  return zeros; a kernel that cannot guarantee it refuses such a plan with a ValueError (the
  managers never plan one: a row's keys include its queries).
- **Output.** A tensor shaped like ``q`` (``[tokens, num_qo_heads, head_dim]``), in ``q``'s
  dtype, on ``q``'s device; rows are isolated: NaN or inf in one row's queries, keys or values
  never reaches another row's output.
- **Plans.** ``plan`` may be called any number of times on one wrapper, with any shapes within
  its constructor's sizes; each replaces the previous plan whole, and ``run`` uses the latest.
  A plan refused with an error leaves the wrapper's previous plan usable or refuses every run
  until the next plan -- never half of each.
- **CUDA graphs.** A capability listed in ``BackendSpec.capturable`` is built with
  ``accelerator_graph=True`` and its maximum sizes (``batch_size``, ``max_total_tokens``,
  ``max_num_pages``); its ``run`` must be capturable (no host synchronisation, no allocation
  that depends on the plan) and a replay after a new plan must compute that plan: plans update
  the buffers the captured kernels read, in place. Rows beyond a plan's are padding.
- **Index arrays** may be host tensors: that is preferred (FlashInfer's own ``plan`` reads them
  on the host, and a device tensor there forces a synchronisation). The one exception is the
  paged ``paged_kv_indices``: the paged KV manager passes it as an int32 tensor on the cache's
  device (gathered there from its page table, so a plan's host work does not grow with the
  context), and the host arrays beside it; only the mixed wrapper gets host page indices (its
  split is host arithmetic). A paged wrapper must accept either.
- **Features** (``mstar_core.features``) arrive only where the backend declares them for the
  capability: ``logits_soft_cap`` and ``kv_data_type`` (an FP8 cache) as plan keywords,
  ``k_scale``/``v_scale`` (FP8) and ``sinks`` (``[num_qo_heads]`` float32) as run keywords.
  A wrapper given one it does not implement raises rather than compute without it.

The paged layer (``kv_cache_layer``) is ``[num_pages, 2, page_size, num_kv_heads, head_dim]``:
``[:, 0]`` keys, ``[:, 1]`` values. Row i owns pages ``paged_kv_indices[paged_kv_indptr[i]:
paged_kv_indptr[i+1]]`` in order; all are full except the last, which holds
``paged_kv_last_page_len[i]`` tokens (``kv_lens[i]`` is the row's total, given beside it).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class PagedPrefillWrapper(Protocol):
    """Batched prefill over a paged layer view; ``run(q [tokens, Hq, D], layer) -> [tokens, Hq, D]``.
    Row i's queries are ``q[qo_indptr[i]:qo_indptr[i+1]]``; ``dtype`` is the queries' (and, without
    ``kv_data_type``, the cache's) dtype.

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
        sm_scale: float | None = None,
        **kwargs: Any,
    ) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class PagedDecodeWrapper(Protocol):
    """Batched decode; ``run(q [rows, Hq, D], layer) -> [rows, Hq, D]``: one query per row, the
    row's last position. A wrapper whose backend declares ``multi_token_decode`` on paged_decode
    (plugin API 1.1) also gets uniform rows of 2..8 queries: ``plan(..., query_tokens=t)`` and
    ``q [rows * t, Hq, D]``, causal (graph mode: built with ``query_tokens=t`` too); elsewhere the
    managers plan those rows on a prefill wrapper that declares them.

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
        sm_scale: float | None = None,
        **kwargs: Any,
    ) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class MixedWrapper(Protocol):
    """A step mixing one-token rows with prompt rows, in any order. Constructor:
    ``(decode_workspace, prefill_workspace, num_qo_heads, num_kv_heads, head_dim, page_size,
    batch_size, max_total_tokens, max_num_pages, max_prefill_rows, device, backend='auto')``
    (the sizes bound every plan: rows, query tokens, pages, rows of more than one query);
    ``plan`` and ``run`` as the prefill wrapper's, with host page indices."""

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
        sm_scale: float | None = None,
        **kwargs: Any,
    ) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class PrefixedPrefillWrapper(Protocol):
    """One varlen pass: segment i's queries ``q[cu_q[i]:cu_q[i+1]]`` attend keys
    ``k[cu_k[i]:cu_k[i+1]]`` = [frozen prefix | fresh], causal masks aligned bottom-right;
    ``run(q [tokens, Hq, D], k, v [keys, Hkv, D]) -> [tokens, Hq, D]``. ``max_q``/``max_k`` are
    the longest segment's counts; ``cu_q``/``cu_k`` int32 host tensors. Not capturable: the dense
    path runs eagerly.

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
