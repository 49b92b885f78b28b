"""Stand-in for flashinfer.attention's ``BatchAttentionWithAttentionSinkWrapper`` (0.5.3
attention.py:201-275): a paged prefill whose module is the AttentionSink variant, built at
construction for the given dtypes, head dims and window switch, under the name the real one gives
it (which names neither the KV dtype nor the head dims). Its ``plan`` and ``run`` are the paged
prefill's jit path: ``run(q, paged_kv_cache, sink, sm_scale)`` (see ``_variant``)."""

from __future__ import annotations

import torch

from .jit.attention.variants import attention_sink_decl
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .utils import determine_attention_backend

# jit/utils.py filename_safe_dtype_map (the entries a 16-bit or FP8 module is named by)
_SAFE = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_POS = {"NONE": 0, "ROPE_LLAMA": 1, "ALIBI": 2}


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
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
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        q_data_type: torch.dtype = torch.bfloat16,
        kv_data_type: torch.dtype = torch.bfloat16,
        head_dim_qk: int = 128,
        head_dim_vo: int = 128,
        window_left: int = -1,
    ) -> None:
        assert backend in ["fa2", "fa3", "auto"]
        if backend == "auto":
            backend = determine_attention_backend(float_workspace_buffer.device, _POS[pos_encoding_mode],
                                                  use_fp16_qk_reduction, custom_mask_buf is not None, q_data_type,
                                                  kv_data_type)
        jit_args = [
            f"batch_prefill_attention_sink_{_SAFE.get(q_data_type, str(q_data_type))}_swa_{window_left >= 0}_{backend}",
            q_data_type, kv_data_type, q_data_type, torch.int32, head_dim_qk, head_dim_vo,
            ["sink"], ["float"], ["sm_scale"], ["double"], "AttentionSink", attention_sink_decl[backend],
        ]
        jit_kwargs = {"use_sliding_window": window_left >= 0, "use_fp16_qk_reduction": use_fp16_qk_reduction,
                      "pos_encoding_mode": _POS[pos_encoding_mode]}
        super().__init__(
            float_workspace_buffer=float_workspace_buffer, kv_layout=kv_layout, use_cuda_graph=use_cuda_graph,
            qo_indptr_buf=qo_indptr_buf, paged_kv_indptr_buf=paged_kv_indptr_buf,
            paged_kv_indices_buf=paged_kv_indices_buf, paged_kv_last_page_len_buf=paged_kv_last_page_len_buf,
            custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf, backend=backend, jit_args=jit_args,
            jit_kwargs=jit_kwargs,
        )
