"""Reference prefixed ragged prefill (plugin contract 2.0: ``from_size`` and ``plan(RaggedPlan)``;
the loose ``plan`` arguments too): queries are each segment's fresh tokens, keys are
[frozen prefix | fresh], packed by ``cu_k``. ``plan`` cuts the rows into chunks and computes each
chunk's key index once; ``run`` gathers one chunk's keys at a time (see :mod:`.math`)."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.attention.plans import RaggedPlan, WrapperSize, ragged_plan
from mstar_core.backends.reference.math import Padding, attend_padded, build_padding, gather_ragged_slots
from mstar_core.backends.reference.paged import run_extras
from mstar_core.errors import InputError, StateError


class ReferencePrefixedPrefillWrapper:
    @classmethod
    def from_size(cls, size: WrapperSize) -> ReferencePrefixedPrefillWrapper:
        return cls(size.num_qo_heads, size.num_kv_heads, size.head_dim, size.device)

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
        cu_q: torch.Tensor | RaggedPlan,
        cu_k: torch.Tensor | None = None,
        max_q: int = 0,
        max_k: int = 0,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        **unknown: Any,
    ) -> None:
        """``plan(RaggedPlan)`` (contract 2.0), or the loose arguments, checked as the core checks them."""
        who = f"{type(self).__name__}.plan"
        if unknown:
            raise InputError(f"{who} got unexpected keyword arguments {sorted(unknown)}")
        if hasattr(cu_q, "kind"):  # a paged plan object
            raise InputError(f"{who}: a {cu_q.kind} plan; this wrapper runs prefixed ragged plans (RaggedPlan)")
        p = cu_q if isinstance(cu_q, RaggedPlan) else ragged_plan(
            cu_q, cu_k, max_q, max_k, dtype, causal=causal, window_left=window_left, sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap, who=who)
        q64, k64 = p.cu_q.to(torch.int64), p.cu_k.to(torch.int64)
        q_lens, k_lens = q64[1:] - q64[:-1], k64[1:] - k64[:-1]
        self._pad = build_padding(q_lens, k_lens, p.causal, p.window_left, self.device,
                                  num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                                  head_dim=self.head_dim)
        self._slots = gather_ragged_slots(self._pad, k64)
        self._sm_scale = p.sm_scale
        self._soft_cap = p.logits_soft_cap
        self._tokens = (p.tokens, int(k64[-1]))

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
