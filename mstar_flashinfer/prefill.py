"""FlashInferPrefillWrapper: batched prefill over a paged KV cache."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.plugin import MAX_DECODE_QUERY_TOKENS, PAGED_PREFILL, InputError, PagedPlan, WrapperSize
from mstar_flashinfer import compat
from mstar_flashinfer.jit_notice import plan_first_use
from mstar_flashinfer.library import flashinfer
from mstar_flashinfer.loose import loose_paged, plan_object
from mstar_flashinfer.paged_base import PagedWrapperBase, PlanArray, Rows, pad_rows, plan_extras, rows_of
from mstar_flashinfer.refusals import refuse_keyless, require
from mstar_flashinfer.sinks import plan_sinks


class FlashInferPrefillWrapper(PagedWrapperBase):
    """Batched prefill attention with paged KV cache.

    Wraps ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (NHD layout) with an optional CUDA
    graph mode on static buffers. KV writes are the KVManager's job; ``kv_write_locations()``
    gives the locations this plan implies, on request.

    In graph mode ``plan`` takes up to ``batch_size`` rows (fewer are padded with empty rows),
    ``max_total_tokens`` tokens and ``max_num_pages`` pages, and ``run`` accepts q with the
    planned number of rows or ``max_total_tokens`` rows (rows past the planned tokens come back
    unspecified).
    """

    kind = "prefill"
    # Graph mode sizes the split-KV scratch for the static maximum: fa2 needed 149 MB for 64 rows
    # x 4 tokens on the H200, past the usual 128 MiB. Callers that build graph-mode wrappers (the
    # paged manager) give it this many times their workspace; from_size does it itself.
    graph_workspace_factor = 2
    # Graph mode: are the rows multi-token decode rows (see _short_rows_backend)? None: judged
    # from the static shape; the mixed wrapper says False for its prompt rows.
    short_rows: bool | None = None

    def __init__(
        self,
        workspace_buffer: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int | None = None,
        max_total_tokens: int | None = None,
        max_num_pages: int | None = None,
        device: torch.device = torch.device("cuda"),
        accelerator_graph: bool = False,
        enable_nvtx: bool = False,
        backend: str = "auto",
        *,
        short_rows: bool | None = None,
    ) -> None:
        self.short_rows = short_rows
        super().__init__(workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size, batch_size,
                         max_total_tokens, max_num_pages, device, accelerator_graph, enable_nvtx, backend)

    @classmethod
    def _workspace(cls, size: WrapperSize) -> torch.Tensor:
        if not size.accelerator_graph:
            return size.workspace()
        return torch.empty(cls.graph_workspace_factor * size.workspace_bytes, dtype=torch.uint8, device=size.device)

    def _init(self, size: WrapperSize, workspace_buffer: torch.Tensor, enable_nvtx: bool) -> None:
        super()._init(size, workspace_buffer, enable_nvtx)
        self._bufs: dict[str, torch.Tensor] | None = None
        if self.accelerator_graph:
            self._bufs = self._graph_buffers(with_qo=True)
            self._static_q = require("max_total_tokens", self.max_total_tokens,
                                     "for FlashInferPrefillWrapper with accelerator_graph=True")
        # FlashInfer's wrapper per backend: the one asked for, and fa2 for an FP8 cache under
        # 16-bit queries (see _inner_for); the sink variant's in ``_sink_inners``. ``_inner`` is
        # the one the latest plan used.
        self._inners: dict[str, Any] = {}
        self._inner = self._make_inner(self._short_rows_backend(self.backend))
        self._per_plan_backend = (not self.accelerator_graph
                                  and compat.picks_backend_per_plan(self._inner, self.backend))

    def _make_inner(self, backend: str) -> Any:
        inner = self._inners.get(backend)
        if inner is not None:
            return inner
        fi = flashinfer()
        if self._bufs is not None:
            assert self._static_q is not None  # graph mode: set from max_total_tokens at build
            # FlashInfer fixes the graph's token budget at its first plan; fix it at the static
            # size instead, so a first plan with fewer tokens does not refuse every larger one.
            inner = compat.graph_prefill(
                fi.BatchPrefillWithPagedKVCacheWrapper, self._static_q, self.workspace_buffer, "NHD",
                use_cuda_graph=True, qo_indptr_buf=self._bufs["qo_indptr"], paged_kv_indptr_buf=self._bufs["kv_indptr"],
                paged_kv_indices_buf=self._bufs["kv_indices"], paged_kv_last_page_len_buf=self._bufs["last_page_len"],
                backend=compat.graph_backend(fi, backend, self.device),
            )
        else:
            inner = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, "NHD", backend=backend)
        self._inners[backend] = inner
        return inner

    # Query tokens per row up to which a graph-mode prefill is multi-token decode (speculative
    # verification rows).
    SHORT_ROWS = MAX_DECODE_QUERY_TOKENS

    def _short_rows_backend(self, backend: str) -> str:
        """A graph-mode prefill sized for rows of at most ``SHORT_ROWS`` tokens (multi-token
        decode) runs on fa2 where "auto" is asked: fa2 packs a KV head's query heads into one tile,
        as the tensor-core decode does, while fa3 pads each head's few queries to a full tile and
        reads the KV once per query head (measured on the H200: 64 rows x 4 tokens over 8192, 32
        layers, about 90 ms a step on fa3)."""
        if backend != "auto" or self._bufs is None or self.device.type != "cuda" or not self.batch_size:
            return backend
        short = self.short_rows
        if short is None:
            assert self._static_q is not None  # graph mode (self._bufs): set from max_total_tokens
            short = self._static_q <= self.SHORT_ROWS * self.batch_size
        return "fa2" if short else backend

    def _inner_for(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
        """FlashInfer's sm90 (fa3) prefill kernels take q and K/V in one dtype: with an FP8 cache
        under 16-bit queries they fail to compile (0.5.3 measured on the H200), and its "auto"
        picks them on Hopper regardless. Such plans run on fa2, which dequantises K/V in the
        kernel (as its tensor-core decode does). A graph captured after this plan replays the
        wrapper this plan chose; later plans of the same dtypes choose it again."""
        if kv_dtype == q_dtype or self.device.type != "cuda":
            return self._inners[self._short_rows_backend(self.backend)]
        if self.backend == "fa3":
            raise InputError(f"{type(self).__name__}.plan: FlashInfer's fa3 prefill kernels need q and K/V in one "
                             f"dtype; a {kv_dtype} cache under {q_dtype} queries needs backend 'auto' or 'fa2'")
        return self._make_inner("fa2" if self.backend == "auto" else self.backend)

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
        """Plan attention and compute KV write indices (lazily: ``kv_write_locations()``).

        Contract 2.0: ``plan(PagedPlan)``, a paged_prefill plan the core built and checked.
        The loose form (the other arguments) builds that plan with the core's ``paged_plan``.

        ``window_left`` is the number of preceding positions each query sees; -1 is unbounded.
        In CUDA graph mode, updates the static buffers via ``.copy_()`` so the same GPU addresses
        are used during graph replay.

        Inputs may be on CPU, and that is preferred: FlashInfer's plan reads ``indptr`` and
        ``last_page_len`` on the host, and a device tensor there forces a synchronisation. Host
        arrays are staged in this wrapper's page-locked per-slot buffers and copied
        asynchronously. ``paged_kv_indices`` may also be an int32 tensor already on the device
        (the KV manager gathers it there): it is used as it is, its length checked but its values
        not (reading them would synchronise), so a wrong page index there is not caught here.
        """
        who = f"{type(self).__name__}.plan"
        plan = plan_object(qo_indptr, paged_kv_indptr is not None or bool(kwargs), PAGED_PREFILL, who)
        if plan is None:
            plan = loose_paged(PAGED_PREFILL, who, self.device, self.page_size, qo_indptr, paged_kv_indptr,
                               paged_kv_indices, paged_kv_last_page_len, causal, dtype, kv_lens, window_left, kwargs)
        assert isinstance(plan, PagedPlan)
        if not plan.keys_cover_queries:
            refuse_keyless(who, plan.qo_indptr, plan.kv_lens.numpy(), plan.causal, "row")
        self._device_indices(plan, who)
        self._plan_rows(plan, rows_of(plan))

    def _plan_rows(self, plan: PagedPlan, r: Rows) -> None:
        """FlashInfer's plan of ``plan``'s settings over rows ``r`` (the plan's own, or the prompt
        rows of a mixed step); refusals first, so a refused plan keeps the previous one."""
        with self._nvtx("plan"):
            extras = plan_extras(plan)
            dtype, window_left = plan.dtype, plan.window_left
            sink_plan = plan_sinks(plan.sink_logits, extras, dtype, self.head_dim, self.backend, type(self).__name__)
            rows, tokens = r.qo.shape[0] - 1, int(r.qo[-1])
            qo, indptr, indices, last, lens = r.qo, r.indptr, r.indices, r.last, r.lens
            max_page, pad = r.max_page, 0
            if self._bufs is not None:
                assert self.batch_size is not None  # graph mode: required at build (_graph_buffers)
                self._check_graph_fit(rows, tokens, r)
                pad = self.batch_size - rows
                if pad:
                    max_page = max(max_page, self.SINK_PAGE)  # each padding row reads the sink page
                    qo, indptr, indices, last, lens = pad_rows(self.batch_size, r, self.SINK_PAGE)
            if sink_plan is None:
                inner, family = self._inner_for(dtype, extras["kv_data_type"]), "paged prefill"
            else:
                inner = self._sink_inner(self._short_rows_backend(self.backend), dtype, window_left, self._bufs,
                                         self._static_q or 0)
                family = "paged prefill (sink logits)"
            with self._plan_slot(r, tokens, max_page) as st:
                qo_s, indptr_s, last_s, lens_s = self._stage_rows(st, (qo, indptr, last, lens))
                indices_s = self._stage_indices(indices, self._bufs, pad)
                st.wait_previous()  # FlashInfer's own pinned plan buffer: see staging.py
                per_plan = self._per_plan_backend and inner is self._inners.get(self.backend)
                with plan_first_use(family, dtype, extras["kv_data_type"], self.head_dim, window_left,
                                    extras["logits_soft_cap"], self.backend, r.qo if per_plan else None):
                    self._inner, self._sink_plan = inner, sink_plan
                    inner.plan(
                        qo_s, indptr_s, indices_s, last_s, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                        self.page_size, causal=plan.causal, window_left=window_left, non_blocking=True,
                        seq_lens=lens_s, **extras,
                    )

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Run planned batched prefill attention.

        ``q`` ``[total_tokens, num_qo_heads, head_dim]``; ``kv_cache_layer``
        ``[max_pages, 2, page_size, num_kv_heads, head_dim]`` (one layer of the cache).
        Returns ``[total_tokens, num_qo_heads, head_dim]``. FP8 storage: as the decode wrapper's.
        ``sinks`` ``[num_qo_heads]``: required after a plan with ``sink_logits=True``, refused otherwise.
        """
        self._check_run(q, kv_cache_layer)
        with self._nvtx("run"):
            if self._bufs is not None:  # graph mode: the planned rows or the static size (checked above)
                compat.tell_q_rows(self._inner, q.shape[0])
            # out= given: FlashInfer 0.7's paged prefill zero-fills an output it allocates (one more kernel)
            return self._run_kernel(q, kv_cache_layer, self._out(q), k_scale, v_scale, sinks)
