"""``AiterPrefixedPrefillWrapper``: the dense path's prefixed ragged prefill on ROCm over
AITER's ``aiter.flash_attn_varlen_func`` (CK flash attention).

Signature used (ROCm/aiter, ``aiter/ops/mha.py``): ``flash_attn_varlen_func(q, k, v,
cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
causal=False, window_size=(-1, -1), bias=None, alibi_slopes=None, deterministic=False,
return_lse=False, return_attn_probs=False, block_table=None)``; it returns ``out`` alone unless
asked for more, a tuple otherwise — both are accepted. Its causal mask is aligned bottom-right.
Only keyword arguments every version has are passed.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


class AiterPrefixedPrefillWrapper:
    """Prefixed ragged prefill through AITER. ``workspace_buffer`` and ``backend`` are accepted
    for the common constructor and unused."""

    kernel = "aiter.flash_attn_varlen_func"

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        workspace_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"AITER varlen attention supports head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        # Imported here: the plugin must load where AITER is not installed.
        self._varlen = importlib.import_module("aiter").flash_attn_varlen_func
        self._planned = False

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
    ) -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"AITER varlen attention supports dtypes {SUPPORTED_DTYPES}, got {dtype}")
        cu_q = torch.as_tensor(cu_q, dtype=torch.int32)
        cu_k = torch.as_tensor(cu_k, dtype=torch.int32)
        if cu_q.shape != cu_k.shape or cu_q.dim() != 1:
            raise ValueError(f"cu_q and cu_k must be 1-D of equal length, got {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
        self._tokens = (int(cu_q[-1]), int(cu_k[-1]))
        self._cu_q = cu_q.to(self.device, non_blocking=True)  # once per step, not per layer
        self._cu_k = cu_k.to(self.device, non_blocking=True)
        self._max = (int(max_q), int(max_k))
        self._causal = causal
        self._dtype = dtype
        self._scale = sm_scale
        self._window = (window_left, 0 if causal else -1) if window_left >= 0 else (-1, -1)
        self._planned = True

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self._planned:
            raise RuntimeError("AiterPrefixedPrefillWrapper.run before plan")
        tq, tk = self._tokens
        hq, hkv, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        for name, t, want in (("q", q, (tq, hq, d)), ("k", k, (tk, hkv, d)), ("v", v, (tk, hkv, d))):
            if tuple(t.shape) != want:
                raise ValueError(f"AiterPrefixedPrefillWrapper.run: {name} has shape {tuple(t.shape)}, expected {want}")
            if t.dtype != self._dtype:
                raise TypeError(f"AiterPrefixedPrefillWrapper.run: {name} has dtype {t.dtype}, planned {self._dtype}")
        out = self._varlen(
            q, k, v, self._cu_q, self._cu_k, self._max[0], self._max[1],
            dropout_p=0.0, softmax_scale=self._scale, causal=self._causal, window_size=self._window,
        )
        return _first(out)
