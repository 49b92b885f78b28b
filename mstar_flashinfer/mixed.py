"""FlashInferMixedWrapper: a step mixing one-token rows with prompt rows, on two plans."""

from __future__ import annotations

import dataclasses
from typing import Any, Self

import numpy as np
import torch

from mstar_core.plugin import MIXED, InputError, PagedPlan, StateError, WrapperSize
from mstar_flashinfer import compat
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.head_dim import check_flashinfer_head_dim
from mstar_flashinfer.kv_write import KVWriteLocations, to_device, write_locations
from mstar_flashinfer.loose import loose_paged, plan_object
from mstar_flashinfer.mixed_layout import split_mixed
from mstar_flashinfer.nvtx import Nvtx
from mstar_flashinfer.paged_base import PlanArray, PlanState, Rows, check_run_cache, plan_extras
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.refusals import refuse_keyless, refuse_page_range, require
from mstar_flashinfer.sinks import plan_sinks, sink_run
from mstar_flashinfer.staging import Staging


class FlashInferMixedWrapper:
    """A step mixing one-token rows (decode) with prompt rows, on two plans.

    The packed prefill planner over every row costs per row about twice what the decode planner
    does, and its kernel runs the one-token rows as prefill queries. Here the decode wrapper takes
    every row of the bucket (a one-token row attends its own pages; any other row reads one token
    of the sink page, and its output is dropped), and the prefill wrapper takes at most
    ``max_prefill_rows`` prompt rows, their tokens moved to the front by a planned permutation.
    Both are captured at static shapes: the bucket's rows and tokens, and ``max_prefill_rows``
    sequences.

    Every host array is staged in page-locked buffers this wrapper owns: a mixed step plans inline
    on the gpu thread, behind the step in flight.

    ``run`` takes q with the planned number of tokens or ``max_total_tokens`` rows (a captured
    bucket); rows past the planned tokens come back unspecified.
    """

    # Rows that are not one-token rows read one token of this page in the decode plan; their
    # output is dropped, so any page of the layer does, and page 0 always exists.
    SINK_PAGE = 0

    def __init__(
        self,
        decode_workspace: torch.Tensor,
        prefill_workspace: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int,
        max_total_tokens: int,
        max_num_pages: int,
        max_prefill_rows: int,
        device: torch.device,
        backend: str = "auto",
    ) -> None:
        size = WrapperSize(num_qo_heads, num_kv_heads, head_dim, device, page_size, batch_size=batch_size,
                           max_total_tokens=max_total_tokens, max_num_pages=max_num_pages,
                           max_prefill_rows=max_prefill_rows, options={"backend": backend})
        check_flashinfer_head_dim(head_dim, size.device)  # the loose constructor: against the one declaration
        self._init(size, decode_workspace, prefill_workspace)

    @classmethod
    def from_size(cls, size: WrapperSize) -> Self:
        """Contract 2.0: a mixed wrapper for ``size`` (both halves' workspaces made here)."""
        w = cls.__new__(cls)
        w._init(size, size.workspace(), size.workspace())
        return w

    def _init(self, size: WrapperSize, decode_workspace: torch.Tensor, prefill_workspace: torch.Tensor) -> None:
        self.device = size.device
        why = "for FlashInferMixedWrapper"
        self.batch_size = require("batch_size", size.batch_size, why)
        self.max_total_tokens = require("max_total_tokens", size.max_total_tokens, why)
        self.max_num_pages = require("max_num_pages", size.max_num_pages, why)
        self.max_prefill_rows = require("max_prefill_rows", size.max_prefill_rows, why)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = size.num_qo_heads, size.num_kv_heads, size.head_dim
        self.page_size = size.page_size
        # The decode plan holds every row (a non-decode row one sink page); the prefill plan pads
        # to max_prefill_rows with one sink page each: size both so that only the caller's own
        # pages count against max_num_pages.
        dec = dataclasses.replace(size, batch_size=self.batch_size, max_total_tokens=None,
                                  max_num_pages=self.max_num_pages + self.batch_size, accelerator_graph=True)
        pre = dataclasses.replace(size, batch_size=self.max_prefill_rows,
                                  max_num_pages=self.max_num_pages + self.max_prefill_rows, accelerator_graph=True)
        self._dec = FlashInferDecodeWrapper.__new__(FlashInferDecodeWrapper)
        self._dec._init(dec, decode_workspace, False)
        self._pre = FlashInferPrefillWrapper.__new__(FlashInferPrefillWrapper)
        self._pre.short_rows = False  # prompt rows: never the multi-token decode path
        self._pre._init(pre, prefill_workspace, False)
        b, t = self.batch_size, self.max_total_tokens
        i64, dev = torch.int64, self.device
        # Static per-token bookkeeping read by run (and so by a captured graph). The tails past a
        # plan's tokens keep in-range values (identity) so a static-shape run gathers in bounds.
        self._row_token = torch.zeros(b, dtype=i64, device=dev)
        self._perm = torch.arange(t, dtype=i64, device=dev)
        self._gather = torch.arange(b, b + t, dtype=i64, device=dev)
        self._staging = Staging(self.device)
        self._staging.reserve({"row_token": b, "perm": t, "gather": t}, dtype=torch.int64)
        self._nvtx = Nvtx("mstar.flashinfer.mixed", False, self.device)
        self._state: PlanState | None = None
        self.prompt_rows = 0
        self._prompt_tokens = 0

    def plan(
        self,
        qo_indptr: PagedPlan | PlanArray,
        paged_kv_indptr: PlanArray | None = None,
        paged_kv_indices: PlanArray | None = None,
        paged_kv_last_page_len: PlanArray | None = None,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: PlanArray | None = None,
        window_left: int = -1,
        **kwargs: Any,
    ) -> None:
        """Plan both halves: the decode plan over every row, the prefill plan over the prompt
        rows; ``causal`` applies to the prompt rows (a one-token row sees all its keys either way).
        Contract 2.0: ``plan(PagedPlan)``, a mixed plan the core built and checked, its page
        indices on the host (the split is host arithmetic); the loose form builds that plan with
        the core's ``paged_plan``."""
        name = type(self).__name__
        who = f"{name}.plan"
        plan = plan_object(qo_indptr, paged_kv_indptr is not None or bool(kwargs), MIXED, who)
        if plan is None:
            plan = loose_paged(MIXED, who, self.device, self.page_size, qo_indptr, paged_kv_indptr, paged_kv_indices,
                               paged_kv_last_page_len, causal, dtype, kv_lens, window_left, kwargs)
        assert isinstance(plan, PagedPlan)
        with self._nvtx("plan"):
            self._plan(plan, name, who)

    def _plan(self, plan: PagedPlan, name: str, who: str) -> None:
        # Every refusal comes before either half is planned, so a refused plan keeps the previous one.
        if not plan.keys_cover_queries:
            refuse_keyless(who, plan.qo_indptr, plan.kv_lens.numpy(), plan.causal, "row")
        # what sink logits do not run with: refused now, not half-way
        plan_sinks(plan.sink_logits, plan_extras(plan), plan.dtype, self.head_dim, self._pre.backend, name)
        host = plan.kv_indices if plan.kv_indices.is_cpu else plan.kv_indices_host
        if host is None:
            raise InputError(f"{who}: the mixed split is host arithmetic over the page indices; give kv_indices on "
                             f"the host (or kv_indices_host beside them), not only on {plan.kv_indices.device}")
        qo, indptr, last, lens = (plan.qo_indptr.numpy(), plan.kv_indptr.numpy(), plan.kv_last_page_len.numpy(),
                                  plan.kv_lens.numpy())
        indices = host.numpy()[: int(indptr[-1])]
        rows, n = plan.rows, plan.tokens
        if rows > self.batch_size:
            raise InputError(f"{who}: {rows} rows exceed batch_size={self.batch_size}")
        if not 0 < n <= self.max_total_tokens:
            raise InputError(f"{who}: {n} tokens; expected 1 to max_total_tokens={self.max_total_tokens}")
        if indices.shape[0] > self.max_num_pages:
            raise InputError(f"{who}: {indices.shape[0]} pages exceed max_num_pages={self.max_num_pages}")
        if plan.max_page >= self.max_num_pages:
            refuse_page_range(who, indices, self.max_num_pages)
        lay = split_mixed(qo, indptr, indices, last, lens, self.SINK_PAGE, self.batch_size)
        if lay.prompt_rows > self.max_prefill_rows:
            raise InputError(
                f"{who}: {lay.prompt_rows} prompt rows (rows of more than one token) exceed "
                f"max_prefill_rows={self.max_prefill_rows}; plan such a step with the prefill wrapper"
            )
        top = max(plan.max_page, self.SINK_PAGE)
        try:
            self._dec._plan_rows(plan, Rows(self._dec.one_per_row(rows), lay.dec_indptr, lay.dec_indices,
                                            lay.dec_last, lay.dec_lens, top))
            self._pre._plan_rows(plan, Rows(lay.pre_qo, lay.pre_indptr, lay.pre_indices, lay.pre_last,
                                            lay.pre_lens, plan.max_page))
        except BaseException:
            self._state = None  # one half may hold the new plan, the other the old: run neither
            raise
        st = self._staging
        st.begin()
        st.copy(self._row_token, st.put("row_token", lay.row_token, torch.int64))
        st.copy(self._perm[:n], st.put("perm", lay.perm, torch.int64))
        st.copy(self._gather[:n], st.put("gather", lay.gather, torch.int64))
        st.end()
        # padding rows and the decode half's prompt rows read the sink page
        self._state = PlanState(qo, indptr, indices, lens, n, max_page=top)
        self.prompt_rows = lay.prompt_rows
        self._prompt_tokens = int(lay.pre_qo[-1])

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` ``[tokens, num_qo_heads, head_dim]`` over ``kv_cache_layer``
        ``[max_pages, 2, page_size, num_kv_heads, head_dim]``; returns ``[tokens, num_qo_heads, head_dim]``.
        FP8 storage and ``sinks``: as the decode wrapper's."""
        st = self._state
        if st is None:
            raise StateError(f"{type(self).__name__}.run before plan")
        n = q.shape[0]
        if n != st.tokens and n != self.max_total_tokens:
            raise InputError(
                f"{type(self).__name__}.run: q has {n} rows, expected {st.tokens} (planned) or "
                f"{self.max_total_tokens} (static)")
        check_run_cache(type(self).__name__, self.device, q, kv_cache_layer, st.max_page, self.page_size,
                        self.num_kv_heads, self.head_dim)
        sink_run(type(self).__name__, self._dec._sink_plan, sinks, self.num_qo_heads, self.device)  # both halves'
        b, p = self.batch_size, self._prompt_tokens
        # One output buffer: decode rows first, then the prefill rows; one gather restores order.
        buf = q.new_empty((b + n, q.shape[1], q.shape[2]))
        scales = (k_scale, v_scale, sinks)
        self._dec._run_kernel(q.index_select(0, self._row_token), kv_cache_layer, buf[:b], *scales)
        if n != self.max_total_tokens:
            # Eager: the prefill half gets exactly its planned (prompt) tokens, as FlashInfer 0.7
            # requires; the other tokens' rows of buf are never gathered. (A q of the static size
            # takes the other branch even when the plan fills it: a graph captured then must
            # replay with every later plan.)
            if p:
                compat.tell_q_rows(self._pre._inner, p)  # a static run before may have said n
                self._pre._run_kernel(q.index_select(0, self._perm[:p]), kv_cache_layer, buf[b:b + p], *scales)
        else:
            # Static (a captured bucket): every shape is fixed at capture, so the prefill half sees
            # all n rows; the kernel reads only the planned ones (compat.tell_q_rows).
            compat.tell_q_rows(self._pre._inner, n)
            self._pre._run_kernel(q.index_select(0, self._perm[:n]), kv_cache_layer, buf[b:], *scales)
        return buf.index_select(0, self._gather[:n])

    def kv_write_locations(self) -> KVWriteLocations:
        """Where this plan's tokens are written in the paged cache, in packed order."""
        st = self._state
        if st is None:
            raise StateError(f"{type(self).__name__}.kv_write_locations before plan")
        if st.locations is None:
            assert isinstance(st.kv_indices, np.ndarray)  # plan keeps host indices
            pages, offs = write_locations(st.qo_indptr, st.kv_indptr, st.kv_indices, st.kv_lens, self.page_size)
            st.locations = to_device(pages, offs, self.device)
        return st.locations
