"""The wrappers' loose-argument ``plan`` (the seed's signatures, contract 1.x) turned into the
core's plan object, so the loose form and contract 2.0 share one set of checks and messages
(``paged_plan`` / ``ragged_plan``) and one planning path; and the refusal of a plan object of
another capability."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.plugin import (
    PREFIXED_RAGGED,
    InputError,
    InputTypeError,
    PagedPlan,
    RaggedPlan,
    check_same_device,
    paged_plan,
    ragged_plan,
)
from mstar_flashinfer.head_dim import check_flashinfer_dtype

# The keywords a paged plan takes beyond its layout (FlashInfer's names).
PLAN_KEYWORDS = ("sm_scale", "logits_soft_cap", "kv_data_type", "sink_logits")


def plan_object(first: Any, rest: bool, kind: str, who: str) -> PagedPlan | RaggedPlan | None:
    """The plan object ``plan`` was given (contract 2.0), or None for the loose form. ``rest``:
    whether other arguments came with it. One of another capability (``kind``) is refused."""
    if not isinstance(first, (PagedPlan, RaggedPlan)):
        return None
    got = first.kind if isinstance(first, PagedPlan) else PREFIXED_RAGGED
    if got != kind:
        raise InputError(f"{who}: got a {got} plan; this wrapper runs {kind} plans")
    if rest:
        raise InputTypeError(f"{who}: a plan object comes alone; got other arguments with it")
    return first


def loose_paged(kind: str, who: str, device: torch.device, page_size: int, qo: Any, indptr: Any, indices: Any,
                last: Any, causal: bool, dtype: torch.dtype, kv_lens: Any, window_left: int,
                kwargs: dict[str, Any]) -> PagedPlan:
    """The plan of a loose paged ``plan(...)`` call, built and checked by the core."""
    if kwargs:
        unknown = sorted(set(kwargs) - set(PLAN_KEYWORDS))
        if unknown:
            raise InputTypeError(f"{who} got unexpected keyword arguments {unknown}; it accepts {list(PLAN_KEYWORDS)}")
    check_flashinfer_dtype(dtype, device)
    if isinstance(indices, torch.Tensor) and not indices.is_cpu:
        check_same_device(who, device, kv_indices=indices)
    return paged_plan(kind, qo, indptr, indices, last, page_size, dtype, causal=causal,
                      kv_lens=kv_lens, window_left=window_left, who=who, **kwargs)


def loose_ragged(who: str, device: torch.device, cu_q: Any, cu_k: Any, max_q: Any, max_k: Any, causal: bool,
                 dtype: torch.dtype, sm_scale: float | None, window_left: int,
                 logits_soft_cap: float | None) -> RaggedPlan:
    """The plan of a loose ragged ``plan(...)`` call, built and checked by the core."""
    check_flashinfer_dtype(dtype, device)
    return ragged_plan(cu_q, cu_k, max_q, max_k, dtype, causal=causal, window_left=window_left, sm_scale=sm_scale,
                       logits_soft_cap=logits_soft_cap, who=who)
