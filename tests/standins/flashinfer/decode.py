"""Stand-in for flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper (0.5.3 signatures)."""

from __future__ import annotations

from typing import Any

import torch

from ._common import (
    apply_v_scale,
    build_module,
    canonicalize_torch_dtype,
    check_cached_qkv_data_type,
    check_kv_layout,
    check_shape_dtype_device,
    paged_attention,
    refuse_sinks,
    run_sm_scale,
    unpack_paged_kv_cache,
    unsupported,
)


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
    ) -> None:
        check_kv_layout(kv_layout)
        unsupported(jit_args=jit_args)
        self._kv_layout = kv_layout
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        if use_cuda_graph:
            if not torch.is_tensor(paged_kv_indptr_buffer):
                raise ValueError("paged_kv_indptr_buffer should be a torch.Tensor in cudagraph mode")
            if not torch.is_tensor(paged_kv_indices_buffer):
                raise ValueError("paged_kv_indices_buffer should be a torch.Tensor in cudagraph mode")
            if not torch.is_tensor(paged_kv_last_page_len_buffer):
                raise ValueError("paged_kv_last_page_len_buffer should be a torch.Tensor in cudagraph mode")
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        else:
            self._fixed_batch_size = 0
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._use_tensor_cores = use_tensor_cores or backend == "trtllm-gen"
        self._use_cuda_graph = use_cuda_graph
        if use_tensor_cores and use_cuda_graph:
            # as the real one: created once, never updated by plan
            self._qo_indptr_buf = torch.arange(self._fixed_batch_size + 1, dtype=torch.int32, device=self.device)
        self._backend = backend
        self._plan_info = None

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype | None = "float16",
        kv_data_type: str | torch.dtype | None = None,
        data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        unsupported(pos_encoding_mode=pos_encoding_mode, block_tables=block_tables)
        for tensor, name in [(indptr, "indptr"), (indices, "indices"), (last_page_len, "last_page_len")]:
            if tensor.dtype != torch.int32:
                raise ValueError(f"{name} must have dtype torch.int32, got {tensor.dtype}")
        batch_size = len(last_page_len)
        if logits_soft_cap is None:
            logits_soft_cap = 0.0
        qo_indptr_host = torch.arange(batch_size + 1, dtype=torch.int32)
        if self.is_cuda_graph_enabled:
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch_size} "
                    f" mismatches the batch size set during initialization {self._fixed_batch_size}")
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._paged_kv_indptr_buf.copy_(indptr, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=non_blocking)
            self._paged_kv_indices_buf[: len(indices)].copy_(
                indices, non_blocking=(indices.device == self.device) and non_blocking)
        else:
            self._paged_kv_indptr_buf = indptr.to(self.device, non_blocking=non_blocking)
            self._paged_kv_indices_buf = indices.to(self.device, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf = last_page_len.to(self.device, non_blocking=non_blocking)
            self._qo_indptr_buf = qo_indptr_host.to(self.device, non_blocking=non_blocking)
        if not self._use_tensor_cores:
            self._qo_indptr_buf = qo_indptr_host.to(self.device)  # the CUDA-core kernel has no qo_indptr
        if data_type is not None:
            q_data_type = q_data_type if q_data_type is not None else data_type
            kv_data_type = kv_data_type if kv_data_type is not None else data_type
        q_data_type = canonicalize_torch_dtype(q_data_type)
        kv_data_type = canonicalize_torch_dtype(kv_data_type if kv_data_type is not None else q_data_type)
        if fixed_split_size is not None and not self.use_tensor_cores:
            raise ValueError("fixed_split_size is only supported by tensor core decode for now.")
        self._cached_q_data_type, self._cached_kv_data_type = q_data_type, kv_data_type
        if self._backend == "trtllm-gen":
            assert logits_soft_cap == 0.0  # as the real plan (decode.py:988)
        # tensor-core decode runs the fa2 prefill module (0.5.3 decode.py:1026), the other the decode module
        build_module("prefill" if self._use_tensor_cores else "decode", q_data_type, kv_data_type, head_dim,
                     window_left, logits_soft_cap)
        self._batch_size = batch_size
        self._num_qo_heads, self._num_kv_heads = num_qo_heads, num_kv_heads
        self._plan_info = (batch_size,)
        self._window_left = window_left
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale

    begin_forward = plan

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
        q_len_per_req: int | None = 1,
    ) -> torch.Tensor:
        unsupported(return_lse=return_lse)
        assert self._plan_info is not None, "plan info is not initialized"
        refuse_sinks(sinks, self._backend if self._backend == "trtllm-gen" else
                     ("fa2, tensor-core decode" if self._use_tensor_cores else "CUDA-core decode"),
                     "BatchDecodeWithPagedKVCacheWrapper.run")
        k_cache, v_cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        check_cached_qkv_data_type(q, k_cache, self._cached_q_data_type, self._cached_kv_data_type)
        window_left = self._window_left if window_left is None else window_left
        assert window_left == self._window_left
        # q_scale/k_scale multiply sm_scale, v_scale the output after the kernel (decode.py:1257-1381)
        sm_scale = run_sm_scale(self._sm_scale, q.shape[-1], q_scale, k_scale)
        if out is None:
            out = torch.empty_like(q)
        else:
            check_shape_dtype_device(out, q.shape, q.dtype, q.device, "out")
        # One query per row; the tensor-core path runs the prefill kernel NON_CAUSAL, same result.
        out = paged_attention(q, k_cache, v_cache, self._qo_indptr_buf, self._paged_kv_indptr_buf,
                              self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf, self._batch_size,
                              False, window_left, sm_scale, self._kv_layout, out, self._logits_soft_cap)
        return apply_v_scale(out, v_scale)
