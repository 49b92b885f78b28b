"""Stand-ins for flashinfer.prefill's batch wrappers (0.5.3 signatures)."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _variant
from ._common import (
    PROFILE,
    apply_v_scale,
    build_module,
    canonicalize_torch_dtype,
    check_cached_qkv_data_type,
    check_kv_layout,
    check_q_rows,
    check_shape_dtype_device,
    new_out,
    paged_attention,
    ragged_attention,
    refuse_sinks,
    run_sm_scale,
    unpack_paged_kv_cache,
    unsupported,
)
from .page import get_seq_lens


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
    ) -> None:
        check_kv_layout(kv_layout)
        unsupported(custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf)
        # prefill.py:1407-1415: a jit variant's module is built here, once, for its compiled parameters
        self._variant = None if jit_args is None else _variant.load(backend, jit_args, jit_kwargs)
        self._kv_layout = kv_layout
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            if not torch.is_tensor(qo_indptr_buf):
                raise ValueError("qo_indptr_buf should be a torch.Tensor in CUDA graph mode")
            if not torch.is_tensor(paged_kv_indptr_buf):
                raise ValueError("paged_kv_indptr_buf should be a torch.Tensor in CUDA graph mode")
            if not torch.is_tensor(paged_kv_indices_buf):
                raise ValueError("paged_kv_indices_buf should be a torch.Tensor in CUDA graph mode")
            if not torch.is_tensor(paged_kv_last_page_len_buf):
                raise ValueError("paged_kv_last_page_len_buf should be a torch.Tensor in CUDA graph mode")
            self._fixed_batch_size = len(qo_indptr_buf) - 1
            if len(paged_kv_indptr_buf) != self._fixed_batch_size + 1:
                raise ValueError("The length of paged_kv_indptr_buf should be batch_size + 1.")
            if len(paged_kv_last_page_len_buf) != self._fixed_batch_size:
                raise ValueError("The length of paged_kv_last_page_len_buf should be batch_size.")
        else:
            self._fixed_batch_size = 0
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._max_total_num_rows: int | None = None
        self._backend = backend
        self._plan_info = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_q: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        unsupported(custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, pos_encoding_mode=pos_encoding_mode,
                    prefix_len_ptr=prefix_len_ptr, block_tables=block_tables)
        if logits_soft_cap is None:
            logits_soft_cap = 0.0
        q_data_type = canonicalize_torch_dtype(q_data_type)
        kv_data_type = canonicalize_torch_dtype(kv_data_type if kv_data_type is not None else q_data_type)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        batch_size = len(qo_indptr) - 1
        self._batch_size = batch_size
        self._num_qo_heads, self._num_kv_heads, self._head_dim = num_qo_heads, num_kv_heads, head_dim_qk
        qo_indptr_host = qo_indptr.to("cpu")
        total_num_rows = int(qo_indptr_host[-1])
        if PROFILE.q_rows_check:
            self._qo_indptr_last = total_num_rows
        paged_kv_indptr_host = paged_kv_indptr.to("cpu")
        kv_lens_arr_host = (get_seq_lens(paged_kv_indptr_host, paged_kv_last_page_len.to("cpu"), page_size)
                            if seq_lens is None else seq_lens.cpu().flatten())
        if self.is_cuda_graph_enabled:
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total_num_rows
            elif total_num_rows > self._max_total_num_rows:
                raise ValueError(
                    f"The total number of rows in qo_indptr {total_num_rows} in cuda graph mode cannot "
                    f"exceed the number of rows set during initialization {self._max_total_num_rows}.")
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    "The batch size should be fixed during the lifecycle of the wrapper in "
                    f"cuda graph mode, the runtime batch size {batch_size} mismatches the batch size "
                    f"{self._fixed_batch_size} "
                    " set during initialization.")
            if len(paged_kv_indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=non_blocking)
            self._paged_kv_indptr_buf.copy_(paged_kv_indptr, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf.copy_(paged_kv_last_page_len, non_blocking=non_blocking)
            self._paged_kv_indices_buf[: len(paged_kv_indices)].copy_(
                paged_kv_indices, non_blocking=(paged_kv_indices.device == self.device) and non_blocking)
        else:
            self._qo_indptr_buf = qo_indptr.to(self.device, non_blocking=non_blocking)
            self._paged_kv_indptr_buf = paged_kv_indptr.to(self.device, non_blocking=non_blocking)
            self._paged_kv_indices_buf = paged_kv_indices.to(self.device, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf = paged_kv_last_page_len.to(self.device, non_blocking=non_blocking)
        self._cached_q_data_type, self._cached_kv_data_type = q_data_type, kv_data_type
        if self._variant is not None:  # prefill.py:1812-1813: the variant's module, whatever the plan asks
            _variant.check_plan(self._variant, q_data_type, kv_data_type, head_dim_qk, head_dim_vo or head_dim_qk,
                                window_left, logits_soft_cap > 0)
        else:
            build_module("prefill", q_data_type, kv_data_type, head_dim_qk, window_left, logits_soft_cap,
                         self._plan_backend(qo_indptr_host))
        self._max_kv_len = int(kv_lens_arr_host.max()) if len(kv_lens_arr_host) else 0
        self._plan_info = (total_num_rows, batch_size)
        self._causal = causal
        self._window_left = window_left
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale

    begin_forward = plan

    def _plan_backend(self, qo_indptr_host: torch.Tensor) -> str:
        if self._backend == "auto":  # resolved once, at the first plan (0.5.3 prefill.py:1815)
            self._backend = "fa2"
        return self._backend

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *args,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        unsupported(return_lse=return_lse)
        assert self._plan_info is not None, "plan info is not initialized"
        sink = None
        if self._variant is not None:  # the variant's (sink, sm_scale), positionally (prefill.py:2173-2174)
            sink, sm_scale = _variant.run_args(self._variant, args, self._num_qo_heads, self.device, q_scale,
                                               k_scale, sinks)
        else:
            refuse_sinks(sinks, self._backend, "BatchPrefillWithPagedKVCacheWrapper.run")
            # q_scale/k_scale multiply sm_scale, v_scale the output after the kernel (prefill.py:2061-2212)
            sm_scale = run_sm_scale(self._sm_scale, q.size(-1), q_scale, k_scale)
        k_cache, v_cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        check_cached_qkv_data_type(q, k_cache, self._cached_q_data_type, self._cached_kv_data_type)
        check_q_rows(self, q)
        window_left = self._window_left if window_left is None else window_left
        assert window_left == self._window_left
        if out is None:
            out = new_out(q.shape[:-1] + v_cache.shape[-1:], q)
        else:
            check_shape_dtype_device(out, q.shape[:-1] + v_cache.shape[-1:], q.dtype, q.device, "out")
        out = paged_attention(q, k_cache, v_cache, self._qo_indptr_buf, self._paged_kv_indptr_buf,
                              self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf, self._batch_size,
                              self._causal, window_left, sm_scale, self._kv_layout, out, self._logits_soft_cap,
                              sink)
        return apply_v_scale(out, v_scale)


class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
    ) -> None:
        check_kv_layout(kv_layout)
        unsupported(custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf, jit_args=jit_args)
        self._kv_layout = kv_layout
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            if not torch.is_tensor(qo_indptr_buf):
                raise ValueError("qo_indptr_buf should be a torch.Tensor in cuda graph mode")
            if not torch.is_tensor(kv_indptr_buf):
                raise ValueError("kv_indptr_buf should be a torch.Tensor in cuda graph mode")
            self._fixed_batch_size = len(qo_indptr_buf) - 1
            if len(kv_indptr_buf) != self._fixed_batch_size + 1:
                raise ValueError(f"The length of kv_indptr_buf ({len(kv_indptr_buf)}) should be the same as "
                                 f"qo_indptr_buf ({self._fixed_batch_size + 1}).")
        else:
            self._fixed_batch_size = 0
        self._qo_indptr_buf = qo_indptr_buf
        self._kv_indptr_buf = kv_indptr_buf
        self._max_total_num_rows: int | None = None
        self._backend = backend
        self._plan_info = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        unsupported(custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, pos_encoding_mode=pos_encoding_mode,
                    prefix_len_ptr=prefix_len_ptr)
        if logits_soft_cap is None:
            logits_soft_cap = 0.0
        q_data_type = canonicalize_torch_dtype(q_data_type)
        kv_data_type = canonicalize_torch_dtype(kv_data_type if kv_data_type is not None else q_data_type)
        batch_size = len(qo_indptr) - 1
        if len(kv_indptr) != batch_size + 1:
            raise ValueError("The kv_indptr length should be equal to mask_indptr length.")
        total_num_rows = int(qo_indptr.to("cpu")[-1])
        if PROFILE.q_rows_check:
            self._qo_indptr_last = total_num_rows
        if self.is_cuda_graph_enabled:
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total_num_rows
            elif total_num_rows > self._max_total_num_rows:
                raise ValueError(
                    f"The total number of rows in qo_indptr {total_num_rows} in cuda graph mode cannot "
                    f"exceed the number of rows set during initialization {self._max_total_num_rows}.")
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch_size} "
                    f" mismatches the batch size set during initialization {self._fixed_batch_size}.")
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=non_blocking)
            self._kv_indptr_buf.copy_(kv_indptr, non_blocking=non_blocking)
        else:
            self._qo_indptr_buf = qo_indptr.to(self.device, non_blocking=non_blocking)
            self._kv_indptr_buf = kv_indptr.to(self.device, non_blocking=non_blocking)
        self._cached_q_data_type, self._cached_kv_data_type = q_data_type, kv_data_type
        if self._backend == "auto":
            self._backend = "fa2"
        build_module("prefill", q_data_type, kv_data_type, head_dim_qk, window_left, logits_soft_cap, self._backend)
        self._plan_info = (total_num_rows, batch_size)
        self._causal = causal
        self._window_left = window_left
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
    ) -> torch.Tensor:
        unsupported(return_lse=return_lse)
        assert self._plan_info is not None, "plan info is not initialized"
        check_cached_qkv_data_type(q, k, self._cached_q_data_type, self._cached_kv_data_type)
        check_q_rows(self, q)
        sm_scale = self._sm_scale if self._sm_scale is not None else 1.0 / math.sqrt(q.size(-1))
        if out is None:  # uninitialised, as the real ragged run allocates it
            out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
        else:
            check_shape_dtype_device(out, q.shape[:-1] + v.shape[-1:], q.dtype, q.device, "out")
        # No q/k/v scales and no sinks in this run's signature (prefill.py:2840-2849): FP8 K/V are
        # read as stored. FP8 q never gets here (plan refuses it on fa2).
        return ragged_attention(q, k, v, self._qo_indptr_buf, self._kv_indptr_buf, self._causal, self._window_left,
                                sm_scale, out, self._logits_soft_cap)


class BatchPrefillWithPagedKVCacheWrapper074(BatchPrefillWithPagedKVCacheWrapper):
    """0.7.4's constructor: the graph-mode token budget can be given up front (prefill.py 2935-3051,
    the same checks); its other parameters are 0.5.3's, passed through."""

    def __init__(self, *args: Any, variant_owns_mask: bool = False, max_total_num_rows: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if max_total_num_rows is not None:
            if not self._use_cuda_graph:
                raise ValueError("max_total_num_rows requires use_cuda_graph=True")
            if not isinstance(max_total_num_rows, int) or max_total_num_rows < 0:
                raise ValueError("max_total_num_rows must be a nonnegative integer")
        unsupported(variant_owns_mask=variant_owns_mask)
        self._max_total_num_rows = max_total_num_rows
        self._auto = self._backend == "auto"
        self._cuda_graph_backend: str | None = None

    def _determine_auto_backend(self, max_q_len: int) -> str:
        """0.7.4 on Hopper: fa2 for a plan whose longest query is at most 64 tokens, else fa3
        (prefill.py 3232-3281); the stand-in computes with its own math either way."""
        return "fa2" if max_q_len <= 64 else "fa3"

    def _plan_backend(self, qo_indptr_host: torch.Tensor) -> str:
        if not self._auto:
            return self._backend
        if self._cuda_graph_backend is not None:  # graph mode: the first plan's choice, for good (4540-4547)
            return self._cuda_graph_backend
        q_lens = qo_indptr_host[1:] - qo_indptr_host[:-1]
        chosen = self._determine_auto_backend(int(q_lens.max()) if len(q_lens) else 0)
        if self._use_cuda_graph:
            self._cuda_graph_backend = chosen
        return chosen
