"""A prefixed ragged wrapper over a FlashAttention-style ``flash_attn_varlen_func`` — what the
FA3 and AITER backends share (they differ in the module, the head dims and a keyword or two).

Segment i's queries ``q[cu_q[i]:cu_q[i+1]]`` attend keys ``k[cu_k[i]:cu_k[i+1]]`` =
[frozen prefix | fresh]; these kernels align their causal mask bottom-right, which is what a
prefix needs. ``plan`` moves ``cu_q``/``cu_k`` to the device once per step; ``run`` (per layer)
is one kernel call. Library versions differ in what the function returns (``out`` alone, or
``(out, lse)``): both are accepted.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def first_output(result: Any) -> torch.Tensor:
    """``out`` from either return convention of ``flash_attn_varlen_func``."""
    return result[0] if isinstance(result, (tuple, list)) else result


class VarlenPrefixedWrapper:
    """Subclasses name the library (``module``, shown as ``library`` in errors) and its limits.
    ``workspace_buffer`` and ``backend`` are accepted for the common constructor and unused
    (these kernels allocate what they need per call)."""

    module: ClassVar[str]
    library: ClassVar[str]
    head_dim_multiple: ClassVar[int] = 1
    max_head_dim: ClassVar[int] = 256
    extra_kwargs: ClassVar[dict[str, Any]] = {}  # passed on every call

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        workspace_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({num_qo_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        if head_dim < 1 or head_dim % self.head_dim_multiple or head_dim > self.max_head_dim:
            rule = f"a multiple of {self.head_dim_multiple} and " if self.head_dim_multiple > 1 else ""
            raise ValueError(f"{self.library} varlen attention needs head_dim {rule}in 1..{self.max_head_dim}, "
                             f"got {head_dim}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        # Imported here, not at module import: the plugin must load where the library is not installed.
        self._varlen = importlib.import_module(self.module).flash_attn_varlen_func
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
            raise TypeError(f"{self.library} varlen attention supports dtypes {SUPPORTED_DTYPES}, got {dtype}")
        cu_q = torch.as_tensor(cu_q, dtype=torch.int32)
        cu_k = torch.as_tensor(cu_k, dtype=torch.int32)
        if cu_q.shape != cu_k.shape or cu_q.dim() != 1:
            raise ValueError(f"cu_q and cu_k must be 1-D of equal length, got {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
        self._tokens = (int(cu_q[-1]), int(cu_k[-1]))
        # Once per step: every layer's run reuses these device copies.
        self._cu_q = cu_q.to(self.device, non_blocking=True)
        self._cu_k = cu_k.to(self.device, non_blocking=True)
        self._max = (int(max_q), int(max_k))
        self._causal = causal
        self._dtype = dtype
        self._scale = sm_scale
        # The window is (left, right) around the bottom-right-aligned diagonal; causal caps right at 0.
        self._window = (window_left, 0 if causal else -1) if window_left >= 0 else (-1, -1)
        self._planned = True

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        who = type(self).__name__
        if not self._planned:
            raise RuntimeError(f"{who}.run before plan")
        tq, tk = self._tokens
        hq, hkv, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        for name, t, want in (("q", q, (tq, hq, d)), ("k", k, (tk, hkv, d)), ("v", v, (tk, hkv, d))):
            if tuple(t.shape) != want:
                raise ValueError(f"{who}.run: {name} has shape {tuple(t.shape)}, expected {want}")
            if t.dtype != self._dtype:
                raise TypeError(f"{who}.run: {name} has dtype {t.dtype}, planned {self._dtype}")
        out = self._varlen(
            q, k, v, self._cu_q, self._cu_k, self._max[0], self._max[1],
            softmax_scale=self._scale, causal=self._causal, window_size=self._window, **self.extra_kwargs,
        )
        return first_output(out)
