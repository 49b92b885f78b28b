"""FlashInferDecodeWrapper: batched one-token decode over a paged KV cache."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mstar_flashinfer.jit_notice import plan_first_use
from mstar_flashinfer.library import flashinfer
from mstar_flashinfer.paged_base import PagedWrapperBase, PlanArray, pad_rows, plan_extras
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
        fi = flashinfer()
        self.use_tensor_cores = use_tensor_cores(num_qo_heads, num_kv_heads)
        self._family = "paged decode (tensor cores)" if self.use_tensor_cores else "paged decode"
        self._bufs: dict[str, torch.Tensor] | None = None
        if self.accelerator_graph:
            self._bufs = self._graph_buffers(with_qo=False)
            self._static_q = self.batch_size
            self._static_only = True  # the kernel reads q row i for every static row i
            self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace_buffer, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self._bufs["kv_indptr"], paged_kv_indices_buffer=self._bufs["kv_indices"],
                paged_kv_last_page_len_buffer=self._bufs["last_page_len"], backend=backend,
            )
        else:
            self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace_buffer, "NHD", use_tensor_cores=self.use_tensor_cores, backend=backend)
        # A plan with sink logits runs on the sink variant instead (a paged prefill, one query per row).
        self._inner = self._decode
        self._arange: np.ndarray = np.arange(0, dtype=np.int32)

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
        paged_kv_indptr: PlanArray,
        paged_kv_indices: PlanArray,
        paged_kv_last_page_len: PlanArray,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: PlanArray | None = None,
        window_left: int = -1,
        **kwargs: Any,
    ) -> None:
        """Plan decode attention and compute KV write locations (lazily: ``kv_write_locations()``).

        Each request appends exactly 1 token: its write location is the last page at offset
        ``last_page_len - 1`` (``last_page_len`` counts the appended token). ``window_left`` is as
        in the prefill wrapper's plan. Inputs may be on CPU; see the prefill wrapper's plan.
        """
        with self._nvtx("plan"):
            self._check_dtype(dtype)
            extras = plan_extras(kwargs, dtype, type(self).__name__)
            sink_plan = plan_sinks(kwargs, extras, dtype, self.head_dim, self.backend, type(self).__name__)
            _, indptr, indices, last, lens, max_page = self._check_plan(
                paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kv_lens, window_left)
            rows = indptr.shape[0] - 1
            if self._arange.shape[0] < rows + 1:
                self._arange = np.arange(2 * rows + 2, dtype=np.int32)
            qo = self._arange[: rows + 1]
            keep = (qo, indptr, indices, last, lens)
            pad = 0
            if self._bufs is not None:
                assert self.batch_size is not None  # graph mode: required at build (_graph_buffers)
                self._check_graph_fit(rows, rows, indices, max_page)
                pad = self.batch_size - rows
                if rows < self.batch_size:
                    max_page = max(max_page, self.SINK_PAGE)  # each padding row reads the sink page
                qo, indptr, indices, last, lens = pad_rows(
                    self.batch_size, qo, indptr, indices, last, lens, self.SINK_PAGE)
            sink_inner = None if sink_plan is None else self._sink_decode(dtype, window_left)
            with self._plan_slot(keep, max_page) as st:
                if sink_inner is not None:
                    qo_s, indptr_s, last_s, lens_s = self._stage_rows(st, (qo, indptr, last), lens)
                else:
                    indptr_s, last_s, lens_s = self._stage_rows(st, (indptr, last), lens)
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
