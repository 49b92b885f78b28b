"""Reference paged wrappers (plugin contract 2.0: ``from_size`` and ``plan(PagedPlan)``; FlashInfer's
constructor and loose ``plan`` arguments too), in plain PyTorch on any device. ``plan`` takes the
checked plan's per-row arrays; the first ``run`` after it does every
index computation (row chunks, query blocks and each chunk's page slots, see :mod:`.math`),
kept for the other layers, so a plan's host work grows with its rows, not with their context. ``plan``
keeps its index tensors until then (as FlashInfer keeps device inputs): do not change them in
place before the step runs. ``run`` (per layer) gathers each chunk's keys and computes, with no
host sync."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.attention.checks import check_plan_kwargs, check_scale, check_sinks
from mstar_core.attention.plans import PagedPlan, WrapperSize, paged_plan
from mstar_core.backends.reference.math import (
    NO_EXTRAS,
    Extras,
    Padding,
    attend_padded,
    build_padding,
    flat_slots,
    gather_paged_slots,
)
from mstar_core.capabilities import MIXED, PAGED_DECODE, PAGED_PREFILL
from mstar_core.errors import InputError, InputTypeError, StateError


def run_extras(who: str, kv_dtype: torch.dtype | None, cache_dtype: torch.dtype, num_qo_heads: int,
               device: torch.device, soft_cap: float | None, sinks: torch.Tensor | None,
               k_scale: float | None, v_scale: float | None) -> Extras:
    """What a run applies beyond the plan's mask, checked: the cache in the planned KV dtype,
    scales finite and > 0, sinks ``[Hq]``."""
    if kv_dtype is not None and cache_dtype != kv_dtype:
        raise InputTypeError(f"{who}.run: kv_cache_layer has dtype {cache_dtype}, "
                             f"the plan's kv_data_type is {kv_dtype}")
    check_scale(k_scale, "k_scale", f"{who}.run")
    check_scale(v_scale, "v_scale", f"{who}.run")
    if sinks is not None:
        check_sinks(sinks, num_qo_heads, device, f"{who}.run")
    if soft_cap is None and sinks is None and k_scale is None and v_scale is None:
        return NO_EXTRAS
    return Extras(soft_cap, sinks, k_scale, v_scale)


class ReferencePrefillWrapper:
    """Batched prefill over a ``[max_pages, 2, page_size, H_kv, D]`` layer view.

    ``accelerator_graph=True`` accepts ``q`` padded to ``max_total_tokens`` rows (else
    ``batch_size``: one token per row; padding rows get
    zeros) so the graph runner's plumbing can be exercised on a CPU; its shapes are dynamic, so
    it is never captured in a real CUDA graph (``graph_capturable`` False)."""

    graph_capturable = False
    kind = PAGED_PREFILL

    @classmethod
    def from_size(cls, size: WrapperSize) -> ReferencePrefillWrapper:
        return cls(None, size.num_qo_heads, size.num_kv_heads, size.head_dim, size.page_size, size.batch_size,
                   size.max_total_tokens, size.max_num_pages, size.device, size.accelerator_graph)

    def __init__(
        self,
        workspace_buffer: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int | None = None,
        max_total_tokens: int | None = None,
        max_num_pages: int | None = None,
        device: torch.device | str = "cpu",
        accelerator_graph: bool = False,
        enable_nvtx: bool = False,
        backend: str = "auto",
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise InputError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self.device = torch.device(device)
        self.accelerator_graph = accelerator_graph
        self.batch_size = batch_size
        # graph mode: the q rows a captured run sees (the bucket's tokens)
        self._static_q = max_total_tokens if max_total_tokens is not None else batch_size
        self._pad: Padding | None = None
        self._slots: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
        self._flat: tuple[tuple[torch.Tensor], ...] | None = None  # the slots into a flat layer view
        self._planned: tuple | None = None  # plan's per-row arrays and index tensors
        self._sm_scale: float | None = None
        self._soft_cap: float | None = None
        self._kv_dtype: torch.dtype | None = None

    def plan(
        self,
        qo_indptr: torch.Tensor | PagedPlan,
        paged_kv_indptr: torch.Tensor | None = None,
        paged_kv_indices: torch.Tensor | None = None,
        paged_kv_last_page_len: torch.Tensor | None = None,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: torch.Tensor | None = None,
        window_left: int = -1,
        **kwargs: Any,
    ) -> None:
        """``plan(PagedPlan)`` (contract 2.0), or the loose arguments, checked as the core checks them."""
        if isinstance(qo_indptr, PagedPlan):
            self._plan(qo_indptr)
            return
        self._plan(self._loose(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, causal, dtype,
                               kv_lens, window_left, 1, kwargs))

    def _loose(self, qo_indptr: Any, indptr: Any, indices: Any, last: Any, causal: bool, dtype: torch.dtype,
               kv_lens: Any, window_left: int, query_tokens: int, kwargs: dict[str, Any]) -> PagedPlan:
        who = f"{type(self).__name__}.plan"
        sm_scale, soft_cap, kv_dtype = check_plan_kwargs(kwargs, type(self).__name__)
        return paged_plan(self.kind, qo_indptr, indptr, indices, last, self.page_size, dtype, causal=causal,
                          kv_lens=kv_lens, window_left=window_left, sm_scale=sm_scale, logits_soft_cap=soft_cap,
                          kv_data_type=kv_dtype, sink_logits=bool(kwargs.get("sink_logits")),
                          query_tokens=query_tokens, who=who)

    def _plan(self, p: PagedPlan) -> None:
        """Keep the plan's per-row arrays. The padding (row chunks, each key's page slot) is built at
        the first run, not here: it grows with the keys, and a plan's host work stays O(rows) (the
        paged manager plans while the previous step runs). Every layer's run reuses it."""
        if not isinstance(p, PagedPlan) or p.kind != self.kind:
            got = p.kind if isinstance(p, PagedPlan) else type(p).__name__
            raise InputError(f"{type(self).__name__}.plan: a {got} plan; this wrapper runs {self.kind} plans")
        if p.page_size != self.page_size:
            raise InputError(f"{type(self).__name__}.plan: the plan's page_size {p.page_size} is not the wrapper's "
                             f"{self.page_size}")
        qo = p.qo_indptr.to(torch.int64)
        self._pad, self._slots, self._flat = None, None, None
        self._planned = (qo[1:] - qo[:-1], p.kv_lens.to(torch.int64), p.causal, p.window_left,
                         p.kv_indptr.to(torch.int64), p.kv_indices)
        self._sm_scale, self._soft_cap, self._kv_dtype = p.sm_scale, p.logits_soft_cap, p.kv_data_type
        self._total = p.tokens

    def _padding(self) -> tuple[Padding, tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
        if self._pad is None or self._slots is None:
            assert self._planned is not None
            q_lens, lens, causal, window_left, indptr, indices = self._planned
            self._pad = build_padding(q_lens, lens, causal, window_left, self.device, num_qo_heads=self.num_qo_heads,
                                      num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
            self._slots = gather_paged_slots(self._pad, indptr, indices, self.page_size)
            self._flat = flat_slots(self._slots, 2 * self.page_size)
        return self._pad, self._slots

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q [tokens, Hq, D]`` over ``kv_cache_layer``. FP8 storage (the plan's
        ``kv_data_type``) is read as ``stored * k_scale`` / ``* v_scale``; ``sinks [Hq]`` adds a
        logit per query head to each softmax denominator (FlashInfer's run keywords)."""
        if self._planned is None:
            raise StateError(f"{type(self).__name__}.run before plan")
        want = (self._total, self.num_qo_heads, self.head_dim)
        padded = self.accelerator_graph and q.shape[0] == self._static_q and q.shape[0] > self._total
        if tuple(q.shape) != want and not padded:
            raise InputError(f"{type(self).__name__}.run: q has shape {tuple(q.shape)}, "
                             f"expected {want} [tokens, Hq, D]")
        if padded:
            out = q.new_zeros(q.shape)
            out[: self._total] = self.run(q[: self._total], kv_cache_layer, k_scale=k_scale, v_scale=v_scale,
                                          sinks=sinks)
            return out
        want_kv = (2, self.page_size, self.num_kv_heads, self.head_dim)
        if kv_cache_layer.dim() != 5 or tuple(kv_cache_layer.shape[1:]) != want_kv:
            raise InputError(
                f"{type(self).__name__}.run: kv_cache_layer has shape {tuple(kv_cache_layer.shape)}, expected "
                f"[max_pages, {', '.join(map(str, want_kv))}] [pages, 2, page_size, Hkv, D]"
            )
        extras = run_extras(type(self).__name__, self._kv_dtype, kv_cache_layer.dtype, self.num_qo_heads, q.device,
                            self._soft_cap, sinks, k_scale, v_scale)
        pad, slots = self._padding()
        if kv_cache_layer.is_contiguous() and self._flat is not None:
            # [pages * 2 * page_size, Hkv, D]: K at page * 2 * page_size + offset, V page_size rows on
            flat = kv_cache_layer.view(-1, self.num_kv_heads, self.head_dim)
            return attend_padded(q, flat, flat[self.page_size:], pad, self._sm_scale, self._flat, extras)
        # [pages, page_size, Hkv, D] views; each chunk gathers its own keys through its slots
        return attend_padded(q, kv_cache_layer[:, 0], kv_cache_layer[:, 1], pad, self._sm_scale, slots, extras)


class ReferenceDecodeWrapper(ReferencePrefillWrapper):
    """One query token per row -- or ``query_tokens`` per row (multi-token decode, declared on
    paged_decode), causal -- a prefill whose ``qo_indptr`` is ``0, t, 2t ..``."""

    kind = PAGED_DECODE

    @classmethod
    def from_size(cls, size: WrapperSize) -> ReferenceDecodeWrapper:
        return cls(None, size.num_qo_heads, size.num_kv_heads, size.head_dim, size.page_size, size.batch_size,
                   size.max_num_pages, size.device, size.accelerator_graph, query_tokens=size.query_tokens)

    def __init__(
        self,
        workspace_buffer: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int | None = None,
        max_num_pages: int | None = None,
        device: torch.device | str = "cpu",
        accelerator_graph: bool = False,
        enable_nvtx: bool = False,
        backend: str = "auto",
        query_tokens: int = 1,
    ) -> None:
        # graph mode: a bucket of batch_size rows, query_tokens each
        static = None if batch_size is None or query_tokens == 1 else batch_size * query_tokens
        super().__init__(workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size, batch_size,
                         static, max_num_pages, device, accelerator_graph, enable_nvtx, backend)

    # The decode protocol's plan (no qo_indptr, no causal) over the prefill plan it reuses:
    # a decode wrapper is not a drop-in prefill wrapper, by design.
    def plan(  # type: ignore[override]
        self,
        paged_kv_indptr: torch.Tensor | PagedPlan,
        paged_kv_indices: torch.Tensor | None = None,
        paged_kv_last_page_len: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: torch.Tensor | None = None,
        window_left: int = -1,
        query_tokens: int = 1,
        **kwargs: Any,
    ) -> None:
        if isinstance(paged_kv_indptr, PagedPlan):
            self._plan(paged_kv_indptr)
            return
        self._plan(self._loose(None, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, True, dtype, kv_lens,
                               window_left, query_tokens, kwargs))


class ReferenceMixedWrapper(ReferencePrefillWrapper):
    """Decode rows and prompt rows in one step. One padded pass computes both exactly; the
    two-plan split (a decode plan and a prefill plan) is a FlashInfer planning-cost optimisation."""

    kind = MIXED

    @classmethod
    def from_size(cls, size: WrapperSize) -> ReferenceMixedWrapper:
        b, t, n, r = size.batch_size, size.max_total_tokens, size.max_num_pages, size.max_prefill_rows
        if b is None or t is None or n is None or r is None:
            raise InputError(f"{cls.__name__}: a mixed wrapper's WrapperSize needs batch_size, max_total_tokens, "
                             f"max_num_pages and max_prefill_rows (its plans' bounds), got {size}")
        return cls(None, None, size.num_qo_heads, size.num_kv_heads, size.head_dim, size.page_size, b, t, n, r,
                   size.device)

    def __init__(
        self,
        decode_workspace: torch.Tensor | None,
        prefill_workspace: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int,
        max_total_tokens: int,
        max_num_pages: int,
        max_prefill_rows: int,
        device: torch.device | str,
        backend: str = "auto",
    ) -> None:
        super().__init__(prefill_workspace, num_qo_heads, num_kv_heads, head_dim, page_size, batch_size,
                         max_total_tokens, max_num_pages, device)
        self.max_prefill_rows = max_prefill_rows
