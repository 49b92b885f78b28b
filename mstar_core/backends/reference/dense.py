"""Reference prefixed ragged prefill: queries are each segment's fresh tokens, keys are
[frozen prefix | fresh], packed by ``cu_k``. ``plan`` cuts the rows into chunks and computes each
chunk's key index once; ``run`` gathers one chunk's keys at a time (see :mod:`.math`)."""

from __future__ import annotations

import torch

from mstar_core.attention.checks import check_soft_cap
from mstar_core.backends.reference.math import Padding, attend_padded, build_padding, gather_ragged_slots
from mstar_core.backends.reference.paged import run_extras
from mstar_core.errors import InputError, StateError


class ReferencePrefixedPrefillWrapper:
    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        workspace_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise InputError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        self._pad: Padding | None = None
        self._slots: tuple[tuple[torch.Tensor], ...] | None = None

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
        logits_soft_cap: float | None = None,
    ) -> None:
        soft_cap = check_soft_cap(logits_soft_cap, f"{type(self).__name__}.plan")
        cu_q = torch.as_tensor(cu_q).cpu().to(torch.int64)
        cu_k = torch.as_tensor(cu_k).cpu().to(torch.int64)
        q_lens, k_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        self._pad = build_padding(q_lens, k_lens, causal, window_left, self.device, num_qo_heads=self.num_qo_heads,
                                  num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        self._slots = gather_ragged_slots(self._pad, cu_k)
        self._sm_scale = sm_scale
        self._soft_cap = soft_cap
        self._tokens = (int(cu_q[-1]), int(cu_k[-1]))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None
            ) -> torch.Tensor:
        if self._pad is None:
            raise StateError("ReferencePrefixedPrefillWrapper.run before plan")
        tq, tk = self._tokens
        d = self.head_dim
        for name, t, want in (("q", q, (tq, self.num_qo_heads, d)), ("k", k, (tk, self.num_kv_heads, d)),
                              ("v", v, (tk, self.num_kv_heads, d))):
            if tuple(t.shape) != want:
                raise InputError(
                    f"ReferencePrefixedPrefillWrapper.run: {name} has shape {tuple(t.shape)}, expected {want} "
                    f"[tokens, heads, head_dim] (the plan has {tq} queries and {tk} keys)"
                )
        extras = run_extras(type(self).__name__, None, k.dtype, self.num_qo_heads, q.device, self._soft_cap, sinks,
                            None, None)
        return attend_padded(q, k, v, self._pad, self._sm_scale, self._slots, extras)
