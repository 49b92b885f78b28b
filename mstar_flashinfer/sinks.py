"""Sink logits on the paged wrappers: which plans take them, and what ``run`` hands the sink
variant (:mod:`mstar_flashinfer.sink_variant`). A plan says ``sink_logits=True`` and its runs must
bring ``sinks``; a plan without it refuses them, so no run ever computes without its sinks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mstar_core.plugin import InputError, StateError, Unsupported, check_sinks
from mstar_flashinfer.sink_variant import SINK_BACKENDS

# What the AttentionSink variant computes: no soft-cap in its declaration, and K/V in the query
# dtype only here (FlashInfer names no FP8 module for it, and none has been run).
SUPPORTED = ("K/V in the query dtype (float16/bfloat16; no FP8 cache), without logits_soft_cap, on backends "
             f"{' and '.join(SINK_BACKENDS)}")


@dataclass(frozen=True)
class SinkPlan:
    """A plan with ``sink_logits=True``: the softmax scale its runs pass the variant."""

    sm_scale: float

    def run_args(self, sinks: torch.Tensor, k_scale: float | None) -> tuple[torch.Tensor, float]:
        """The variant's ``(sink, sm_scale)``: float32 contiguous sinks, and the scale with
        ``k_scale`` folded in (FlashInfer's jit path folds it into a scale it never passes)."""
        return sinks.to(torch.float32).contiguous(), self.sm_scale * (1.0 if k_scale is None else float(k_scale))


def plan_sinks(sink_logits: bool, extras: dict[str, Any], dtype: torch.dtype, head_dim: int, backend: str,
               who: str) -> SinkPlan | None:
    """The sink plan a plan with ``sink_logits`` asks for, or None; refuses, before anything is
    planned, a combination the sink variant does not compute. ``extras``: from ``plan_extras``."""
    if not sink_logits:
        return None
    kv = extras["kv_data_type"]
    if kv != dtype:
        raise Unsupported(f"{who}.plan: sink logits with a {kv} cache under {dtype} queries: FlashInfer's sink "
                          f"logits run with {SUPPORTED}")
    if extras["logits_soft_cap"]:
        raise Unsupported(f"{who}.plan: sink logits with logits_soft_cap={extras['logits_soft_cap']}: FlashInfer's "
                          f"sink logits run with {SUPPORTED}")
    if backend not in ("auto", *SINK_BACKENDS):
        raise Unsupported(f"{who}.plan: sink logits on backend {backend!r}: FlashInfer's sink logits run with "
                          f"{SUPPORTED} (or 'auto')")
    scale = extras["sm_scale"]
    return SinkPlan(1.0 / math.sqrt(head_dim) if scale is None else float(scale))


def sink_run(who: str, plan: SinkPlan | None, sinks: torch.Tensor | None, num_qo_heads: int,
             device: torch.device) -> None:
    """Refuse ``sinks`` after a plan without ``sink_logits=True``, and a run without them after one with it."""
    if plan is None:
        if sinks is not None:
            raise StateError(f"{who}.run: sinks given, but the plan was made without sink_logits=True; plan with "
                             "sink_logits=True (FlashInfer builds a separate kernel for sink logits)")
        return
    if sinks is None:
        raise InputError(f"{who}.run: the plan was made with sink_logits=True, so run needs sinks "
                         f"[num_qo_heads={num_qo_heads}] (float)")
    check_sinks(sinks, num_qo_heads, device, f"{who}.run")
