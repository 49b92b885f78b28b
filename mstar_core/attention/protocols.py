"""What a backend's wrappers implement under plugin contract 2.0: the contract's code half
(docs/PLUGINS.md is the other; ``mstar check NAME`` tests a backend against both). A wrapper is
built with ``from_size(WrapperSize)`` and planned with the plan object the core built and checked
(``PagedPlan`` for the paged capabilities, ``RaggedPlan`` for the dense path's prefixed ragged
one: query = fresh tokens, keys = [prefix | fresh]). A plugin declaring contract 1.x keeps its
version's loose-argument calls (docs/PLUGINS.md section 11, ``mstar_core.attention.calls``).

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
  its ``WrapperSize``; a plan of another kind (or type) raises; each replaces the previous plan
  whole, and ``run`` uses the latest.
  A plan refused with an error leaves the wrapper's previous plan usable or refuses every run
  until the next plan -- never half of each.
- **CUDA graphs.** A capability listed in ``BackendSpec.capturable`` is built with
  ``accelerator_graph=True`` and its maximum sizes (``batch_size``, ``max_total_tokens``,
  ``max_num_pages``); its ``run`` must be capturable (no host synchronisation, no allocation
  that depends on the plan) and a replay after a new plan must compute that plan: plans update
  the buffers the captured kernels read, in place. Rows beyond a plan's are padding.
- **Index arrays** are int32 host tensors, but for the paged ``kv_indices``: on the cache's device
  for prefill and decode (gathered there from the page table, so a plan's host work does not grow
  with the context), on the host for mixed (its split is host arithmetic).
- **Features** (``mstar_core.features``) arrive only where the backend declares them for the
  capability: ``logits_soft_cap``, ``kv_data_type`` (an FP8 cache), ``sink_logits`` and
  ``query_tokens`` in the plan, ``k_scale``/``v_scale`` (FP8) and ``sinks`` (``[num_qo_heads]``
  float32) as run keywords. A wrapper given one it does not implement raises rather than compute
  without it.

The paged layer (``kv_cache_layer``) is ``[num_pages, 2, page_size, num_kv_heads, head_dim]``:
``[:, 0]`` keys, ``[:, 1]`` values. Row i owns pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``
in order; all are full except the last, which holds ``kv_last_page_len[i]`` tokens
(``kv_lens[i]`` is the row's total).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from mstar_core.attention.plans import PagedPlan, RaggedPlan, WrapperSize


@runtime_checkable
class PagedPrefillWrapper(Protocol):
    """Batched prefill over a paged layer view: ``run(q [tokens, Hq, D], layer) -> [tokens, Hq, D]``,
    row i's queries ``q[plan.qo_indptr[i]:plan.qo_indptr[i+1]]``. A capturable one is built with
    ``size.accelerator_graph`` and the static maxima (``batch_size``, ``max_total_tokens``,
    ``max_num_pages``)."""

    @classmethod
    def from_size(cls, size: WrapperSize) -> Any: ...

    def plan(self, plan: PagedPlan) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...


@runtime_checkable
class PagedDecodeWrapper(Protocol):
    """Batched decode: ``run(q [rows * t, Hq, D], layer) -> [rows * t, Hq, D]``, ``t`` =
    ``plan.query_tokens`` queries per row (1 but where the backend declares ``multi_token_decode``
    on paged_decode: then uniform causal rows of 2..8; graph mode: built with ``size.query_tokens``)."""

    @classmethod
    def from_size(cls, size: WrapperSize) -> Any: ...

    def plan(self, plan: PagedPlan) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...


@runtime_checkable
class MixedWrapper(Protocol):
    """A step mixing one-token rows with prompt rows, in any order, with host page indices. Built
    with ``size.batch_size``, ``max_total_tokens``, ``max_num_pages`` and ``max_prefill_rows``
    (rows of more than one query), which bound every plan; ``plan`` and ``run`` as the prefill
    wrapper's."""

    @classmethod
    def from_size(cls, size: WrapperSize) -> Any: ...

    def plan(self, plan: PagedPlan) -> None: ...

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...


@runtime_checkable
class PrefixedPrefillWrapper(Protocol):
    """One varlen pass: segment i's queries ``q[cu_q[i]:cu_q[i+1]]`` attend keys
    ``k[cu_k[i]:cu_k[i+1]]`` = [frozen prefix | fresh], causal masks aligned bottom-right;
    ``run(q [tokens, Hq, D], k, v [keys, Hkv, D]) -> [tokens, Hq, D]``. Not capturable: the dense
    path runs eagerly."""

    @classmethod
    def from_size(cls, size: WrapperSize) -> Any: ...

    def plan(self, plan: RaggedPlan) -> None: ...

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None
            ) -> torch.Tensor: ...
