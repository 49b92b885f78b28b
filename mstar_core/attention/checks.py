"""Argument checks every wrapper shares: sink logits, soft-cap, K/V scales and a paged plan's
keyword arguments, each refused with a message naming the value and what is allowed, before a
plan or run changes anything."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.errors import InputError, InputTypeError, Unsupported
from mstar_core.step import SCALE_RANGE, check_window_and_scale, is_positive_finite

# FP8 KV storage dtypes a plan's kv_data_type may name (besides the query dtype).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_sinks(sinks: torch.Tensor, num_qo_heads: int, device: torch.device, who: str) -> None:
    """A sink-logit tensor: float ``[num_qo_heads]`` on ``device``. Values are not read (that
    would synchronise with the device)."""
    if not isinstance(sinks, torch.Tensor):
        raise InputTypeError(f"{who}: sinks must be a float tensor [num_qo_heads={num_qo_heads}], got "
                        f"{type(sinks).__name__}")
    if tuple(sinks.shape) != (num_qo_heads,):
        raise InputError(f"{who}: sinks has shape {tuple(sinks.shape)}, expected ({num_qo_heads},) "
                         "(one logit per query head)")
    if not sinks.is_floating_point():
        raise InputTypeError(f"{who}: sinks must be a float tensor, got dtype {sinks.dtype}")
    if sinks.device.type != torch.device(device).type:
        raise InputError(f"{who}: sinks is on {sinks.device}, the cache on {device}")


def check_soft_cap(value: Any, who: str) -> float | None:
    """A plan's ``logits_soft_cap``: None (no cap) or a finite float > 0 (float32's normal range)."""
    if value is None:
        return None
    if not is_positive_finite(value):
        # 0 reads as "off" to some, while c * tanh(s / c) tends to 0 for every score: refused, not guessed
        off = " (0 does not turn the cap off: pass None)" if value == 0 else ""
        raise InputError(f"{who}: logits_soft_cap must be {SCALE_RANGE}, or None for no cap; got {value!r}{off}")
    return float(value)


def check_scale(value: Any, name: str, who: str) -> None:
    """A run's ``k_scale``/``v_scale``: None (1.0) or a finite float > 0 (float32's normal range)."""
    if value is not None and not is_positive_finite(value):
        raise InputError(f"{who}: {name} must be {SCALE_RANGE} (or None: 1.0), got {value!r}")


# The keyword arguments a paged wrapper's plan takes beyond its layout (FlashInfer's names).
# ``sink_logits=True`` says this plan's runs bring ``sinks`` (a kernel that builds a variant for
# them, FlashInfer's, must know before run).
PLAN_KWARGS = ("sm_scale", "logits_soft_cap", "kv_data_type", "sink_logits")


def check_plan_kwargs(kwargs: dict[str, Any], who: str) -> tuple[float | None, float | None, torch.dtype | None]:
    """``(sm_scale, logits_soft_cap, kv_data_type)`` of a paged plan, refusing unknown keywords
    and bad values before the plan changes anything (``sink_logits`` is checked; a wrapper that
    takes ``sinks`` at run needs nothing more from it)."""
    unknown = sorted(set(kwargs) - set(PLAN_KWARGS))
    if unknown:
        raise InputTypeError(f"{who}.plan got unexpected keyword arguments {unknown}; it accepts {list(PLAN_KWARGS)}")
    sm_scale, cap, kv_dtype, sinks = (kwargs.get(k) for k in PLAN_KWARGS)
    if sinks is not None and not isinstance(sinks, bool):
        raise InputTypeError(f"{who}.plan: sink_logits must be a bool, got {sinks!r}")
    check_window_and_scale(f"{who}.plan", -1, sm_scale)
    if kv_dtype is not None and (not isinstance(kv_dtype, torch.dtype) or not kv_dtype.is_floating_point):
        raise InputError(f"{who}.plan: kv_data_type must be a float torch.dtype (the query dtype, or "
                         f"{' / '.join(str(d) for d in FP8_DTYPES)} for an FP8 cache), "
                         f"got {kv_dtype!r}")
    return sm_scale, check_soft_cap(cap, f"{who}.plan"), kv_dtype


def refuse_sinks(sinks: torch.Tensor | None, who: str, why: str) -> None:
    """A wrapper whose kernel takes no sink logits refuses them rather than compute without."""
    if sinks is not None:
        raise Unsupported(f"{who}.run: sink logits are not supported by {why}; use a backend that declares "
                                  "sink_logits")
