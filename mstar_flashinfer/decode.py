"""FlashInferDecodeWrapper: batched one-token decode over a paged KV cache."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mstar_core.plugin import PAGED_DECODE, PagedPlan, Unsupported, WrapperSize
from mstar_flashinfer.jit_notice import plan_first_use
from mstar_flashinfer.library import flashinfer
from mstar_flashinfer.loose import loose_paged, plan_object
from mstar_flashinfer.paged_base import PagedWrapperBase, PlanArray, Rows, pad_rows, plan_extras, rows_of
from mstar_flashinfer.sinks import plan_sinks

# FlashInfer's tensor-core decode (its prefill kernel with one query per row) wins once a KV head
# serves several query heads; below that its CUDA-core decode kernel is the faster one.
TENSOR_CORE_MIN_GQA = 4


def use_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    return num_qo_heads // num_kv_heads >= TENSOR_CORE_MIN_GQA


class FlashInferDecodeWrapper(PagedWrapperBase):
    """Batched decode attention with paged KV cache.

    Optimized for the common decode case where each request appends exactly 1 new token. Uses
    ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``. In graph mode ``run`` takes q with
    ``batch_size`` rows (the captured shape); a plan with fewer rows is padded with rows reading
    one token of a sink page, whose outputs are unspecified.
    """

    kind = "decode"

    def __init__(
        self,
        workspace_buffer: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int | None = None,
        max_num_pages: int | None = None,
        device: torch.device = torch.device("cuda"),
        accelerator_graph: bool = False,
        enable_nvtx: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__(workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size, batch_size,
                         None, max_num_pages, device, accelerator_graph, enable_nvtx, backend)

    def _init(self, size: WrapperSize, workspace_buffer: torch.Tensor, enable_nvtx: bool) -> None:
        super()._init(size, workspace_buffer, enable_nvtx)
        self.max_total_tokens = None  # a decode wrapper holds one query per row
        fi = flashinfer()
        self.use_tensor_cores = use_tensor_cores(self.num_qo_heads, self.num_kv_heads)
        self._family = "paged decode (tensor cores)" if self.use_tensor_cores else "paged decode"
        self._bufs: dict[str, torch.Tensor] | None = None
        if self.accelerator_graph:
            self._bufs = self._graph_buffers(with_qo=False)
            self._static_q = self.batch_size
            self._static_only = True  # the kernel reads q row i for every static row i
            self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace_buffer, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self._bufs["kv_indptr"], paged_kv_indices_buffer=self._bufs["kv_indices"],
                paged_kv_last_page_len_buffer=self._bufs["last_page_len"], backend=self.backend,
            )
        else:
            self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace_buffer, "NHD", use_tensor_cores=self.use_tensor_cores, backend=self.backend)
        # A plan with sink logits runs on the sink variant instead (a paged prefill, one query per row).
        self._inner = self._decode
        self._arange: np.ndarray = np.arange(0, dtype=np.int32)

    def one_per_row(self, rows: int) -> np.ndarray:
        """``qo_indptr`` of ``rows`` one-query rows (a view of a kept arange: no allocation per plan)."""
        if self._arange.shape[0] < rows + 1:
            self._arange = np.arange(2 * rows + 2, dtype=np.int32)
        return self._arange[: rows + 1]

    def _sink_decode(self, dtype: torch.dtype, window_left: int) -> Any:
        """The sink variant for decode rows: fa2 where "auto" is asked, as FlashInfer's tensor-core
        decode is its fa2 prefill kernel (fa3 pads each query head's one query to a full tile).
        Graph mode: the static buffers with a q_indptr of their own (the decode wrapper has none)."""
        if self._bufs is not None and "qo_indptr" not in self._bufs:
            assert self.batch_size is not None  # graph mode: required at build (_graph_buffers)
            self._bufs["qo_indptr"] = torch.zeros(self.batch_size + 1, dtype=torch.int32, device=self.device)
        return self._sink_inner("fa2" if self.backend == "auto" else self.backend, dtype, window_left, self._bufs,
                                self.batch_size or 0)

    def plan(
        self,
        paged_kv_indptr: PagedPlan | PlanArray,
        paged_kv_indices: PlanArray | None = None,
        paged_kv_last_page_len: PlanArray | None = None,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: PlanArray | None = None,
        window_left: int = -1,
        **kwargs: Any,
    ) -> None:
        """Plan decode attention and compute KV write locations (lazily: ``kv_write_locations()``).

        Contract 2.0: ``plan(PagedPlan)``, a paged_decode plan the core built and checked (one
        query per row: FlashInfer's decode kernel takes no more). The loose form (the other
        arguments) builds that plan with the core's ``paged_plan``.

        Each request appends exactly 1 token: its write location is the last page at offset
        ``last_page_len - 1`` (``last_page_len`` counts the appended token). ``window_left`` is as
        in the prefill wrapper's plan. Inputs may be on CPU; see the prefill wrapper's plan.
        """
        who = f"{type(self).__name__}.plan"
        plan = plan_object(paged_kv_indptr, paged_kv_indices is not None or bool(kwargs), PAGED_DECODE, who)
        if plan is None:
            plan = loose_paged(PAGED_DECODE, who, self.device, self.page_size, None, paged_kv_indptr,
                               paged_kv_indices, paged_kv_last_page_len, True, dtype, kv_lens, window_left, kwargs)
        assert isinstance(plan, PagedPlan)
        if plan.query_tokens != 1:
            raise Unsupported(f"{who}: FlashInfer's decode kernel takes one query per row, got {plan.query_tokens}; "
                              "multi-token decode rows run on its prefill wrapper")
        self._device_indices(plan, who)
        self._plan_rows(plan, rows_of(plan))

    def _plan_rows(self, plan: PagedPlan, r: Rows) -> None:
        """FlashInfer's decode plan of ``plan``'s settings over rows ``r`` (the plan's own, or
        every row of a mixed step); refusals first, so a refused plan keeps the previous one."""
        with self._nvtx("plan"):
            extras = plan_extras(plan)
            dtype, window_left = plan.dtype, plan.window_left
            sink_plan = plan_sinks(plan.sink_logits, extras, dtype, self.head_dim, self.backend, type(self).__name__)
            rows = r.indptr.shape[0] - 1
            qo, indptr, indices, last, lens = r.qo, r.indptr, r.indices, r.last, r.lens
            max_page, pad = r.max_page, 0
            if self._bufs is not None:
                assert self.batch_size is not None  # graph mode: required at build (_graph_buffers)
                self._check_graph_fit(rows, rows, r)
                pad = self.batch_size - rows
                if pad:
                    max_page = max(max_page, self.SINK_PAGE)  # each padding row reads the sink page
                    qo, indptr, indices, last, lens = pad_rows(self.batch_size, r, self.SINK_PAGE)
            sink_inner = None if sink_plan is None else self._sink_decode(dtype, window_left)
            with self._plan_slot(r, rows, max_page) as st:
                if sink_inner is not None:
                    qo_s, indptr_s, last_s, lens_s = self._stage_rows(st, (qo, indptr, last, lens))
                else:
                    indptr_s, last_s, lens_s = self._stage_rows(st, (indptr, last, lens))
                indices_s = self._stage_indices(indices, self._bufs, pad)
                st.wait_previous()  # FlashInfer's own pinned plan buffer: see staging.py
                family = self._family if sink_inner is None else "paged decode (sink logits)"
                with plan_first_use(family, dtype,
                                    extras["kv_data_type"], self.head_dim, window_left, extras["logits_soft_cap"],
                                    self.backend):
                    self._inner, self._sink_plan = self._decode if sink_inner is None else sink_inner, sink_plan
                    if sink_inner is None:
                        self._decode.plan(
                            indptr_s, indices_s, last_s, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                            self.page_size, window_left=window_left, non_blocking=True, seq_lens=lens_s, **extras,
                        )
                    else:  # one query per row, the row's last position: causal sees every key of the row
                        sink_inner.plan(
                            qo_s, indptr_s, indices_s, last_s, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                            self.page_size, causal=True, window_left=window_left, non_blocking=True,
                            seq_lens=lens_s, **extras,
                        )

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Run planned batched decode attention: ``q`` ``[n_req, num_qo_heads, head_dim]`` over
        ``kv_cache_layer`` ``[max_pages, 2, page_size, num_kv_heads, head_dim]``; returns
        ``[n_req, num_qo_heads, head_dim]``. An FP8 cache (the plan's ``kv_data_type``) is read as
        ``stored * k_scale`` / ``* v_scale`` (FlashInfer folds ``k_scale`` into the softmax scale
        and scales the output by ``v_scale``). ``sinks`` ``[num_qo_heads]``: required after a plan
        with ``sink_logits=True``, refused otherwise."""
        self._check_run(q, kv_cache_layer)
        with self._nvtx("run"):
            return self._run_kernel(q, kv_cache_layer, self._out(q), k_scale, v_scale, sinks)
