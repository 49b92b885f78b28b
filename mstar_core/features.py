"""What a model asks of attention beyond plain causal / windowed softmax: one typed value,
:class:`AttentionFeatures`, given to the managers and to ``select_backend``.

Backends declare per capability which of :data:`FEATURES` they support
(``BackendSpec.features``); selection refuses a backend that lacks a requested one with a
reason naming it, as it does for head dims and dtypes.

- ``kv_dtype``: ``"auto"`` stores K/V in the model dtype; ``"fp8_e4m3"`` / ``"fp8_e5m2"`` store
  them as FP8 with one K and one V scale per layer (``stored = k / k_scale``, quantised on write;
  kernels read ``stored * k_scale``). Queries stay in the model dtype.
- ``soft_cap``: scores become ``soft_cap * tanh(scores / soft_cap)`` after ``sm_scale``
  (Gemma 2, Grok).
- ``sink_logits``: a learned logit per query head added to each softmax denominator (gpt-oss),
  passed per layer to ``run(..., sinks=)`` (required there once declared). A bool for every
  layer, or one bool per layer (a tuple or list, like ``layer_windows``): a layer without them
  refuses ``sinks``. Not the bounded manager's *sink tokens* (the first tokens a bounded slot keeps).
- ``layer_windows``: ``window_left`` per layer, a tuple or list (-1: full attention); one step
  may mix windowed and full layers. The managers plan once per distinct window and ``run(layer_idx=)`` picks.
- ``decode_query_tokens``: query tokens per decode row (1, or 2..8 for speculative
  verification); a step whose rows all have that many tokens is planned, captured and replayed
  like a one-token decode step.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar_core.attention.checks import check_sinks
from mstar_core.capabilities import FEATURE_REACH
from mstar_core.errors import InputError, InputTypeError
from mstar_core.step import SCALE_RANGE, is_int, is_positive_finite

# KV storage dtypes by name; "auto" is the model dtype.
KV_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# Every feature name a backend may declare, and what a request of it means.
FEATURES: dict[str, str] = {
    "fp8_e4m3": "FP8 (e4m3) KV cache with per-layer K/V scales",
    "fp8_e5m2": "FP8 (e5m2) KV cache with per-layer K/V scales",
    "soft_cap": "logit soft-cap (soft_cap * tanh(scores / soft_cap))",
    "sink_logits": "learned per-head sink logits in the softmax denominator",
    "layer_windows": "a sliding window per layer (windowed and full layers in one step)",
    "multi_token_decode": "uniform decode rows of 2..8 query tokens, captured like one-token decode",
}


MAX_DECODE_QUERY_TOKENS = 8

Scales = float | tuple[float, ...]


def _check_scale(value: Any, what: str) -> float:
    if not is_positive_finite(value):
        raise InputError(f"AttentionFeatures: {what} must be {SCALE_RANGE}, got {value!r}")
    return float(value)


def _windows(value: Any) -> tuple[int, ...]:
    """``layer_windows``: one ``window_left`` per layer, in layer order (a tuple or list); a
    mapping, a set, a string or a single int is refused, naming it."""
    allowed = "a sequence (tuple or list) of one window_left per layer, each an int >= 0 or -1 for a full layer"
    if isinstance(value, Mapping) or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputTypeError(f"AttentionFeatures: layer_windows must be {allowed}; got {type(value).__name__} "
                             f"{value!r}")
    windows = tuple(value)
    if not windows:
        raise InputError("AttentionFeatures: layer_windows must name one window per layer, got none")
    for i, w in enumerate(windows):
        if not is_int(w) or w < -1:
            raise InputError(f"AttentionFeatures: layer_windows[{i}] must be an int >= 0, or -1 for a full "
                             f"layer; got {w!r}")
    return tuple(int(w) for w in windows)


def _sinks(value: Any) -> bool | tuple[bool, ...]:
    """``sink_logits``: a bool, or one bool per layer in layer order (a tuple or list)."""
    if isinstance(value, bool):
        return value
    allowed = "a bool (every layer), or a sequence (tuple or list) of one bool per layer"
    if isinstance(value, Mapping) or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputTypeError(f"AttentionFeatures: sink_logits must be {allowed}; got {type(value).__name__} "
                             f"{value!r}")
    if not value:
        raise InputError(f"AttentionFeatures: sink_logits must be {allowed}; got an empty {type(value).__name__}")
    for i, s in enumerate(value):
        if not isinstance(s, bool):
            raise InputTypeError(f"AttentionFeatures: sink_logits[{i}] must be a bool (True: the layer has sink "
                                 f"logits), got {type(s).__name__} {s!r}")
    return tuple(value)


def _scales(value: Any, what: str) -> Scales:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            raise InputError(f"AttentionFeatures: {what} must be a float > 0 or one per layer, got an empty sequence")
        return tuple(_check_scale(v, f"{what}[{i}]") for i, v in enumerate(value))
    return _check_scale(value, what)


@dataclass(frozen=True)
class AttentionFeatures:
    """What a model's attention asks for (see the module docstring). The default asks for
    nothing beyond plain attention, so every backend serves it."""

    kv_dtype: str = "auto"
    k_scale: Scales = 1.0
    v_scale: Scales = 1.0
    soft_cap: float | None = None
    sink_logits: bool | tuple[bool, ...] = False
    layer_windows: tuple[int, ...] | None = None
    decode_query_tokens: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.kv_dtype, str) or self.kv_dtype not in KV_DTYPES:
            raise InputError(f"AttentionFeatures: kv_dtype {self.kv_dtype!r} is not supported; "
                             f"choose one of {list(KV_DTYPES)}")
        object.__setattr__(self, "k_scale", _scales(self.k_scale, "k_scale"))
        object.__setattr__(self, "v_scale", _scales(self.v_scale, "v_scale"))
        if self.kv_dtype == "auto":
            for what in ("k_scale", "v_scale"):
                value = getattr(self, what)
                if any(x != 1.0 for x in (value if isinstance(value, tuple) else (value,))):
                    # Nothing is quantised, so nothing would read it: refused rather than ignored.
                    raise InputError(f"AttentionFeatures: {what}={value!r} given with kv_dtype 'auto' (K/V stored "
                                     f"in the model dtype, no scales); scales apply to an FP8 cache: set kv_dtype to "
                                     f"one of {[d for d in KV_DTYPES if d != 'auto']}, or leave {what} at 1.0")
        if self.soft_cap is not None:
            object.__setattr__(self, "soft_cap", _check_scale(self.soft_cap, "soft_cap"))
        object.__setattr__(self, "sink_logits", _sinks(self.sink_logits))
        if self.layer_windows is not None:
            object.__setattr__(self, "layer_windows", _windows(self.layer_windows))
        t = self.decode_query_tokens
        if not is_int(t) or not 1 <= t <= MAX_DECODE_QUERY_TOKENS:
            raise InputError(f"AttentionFeatures: decode_query_tokens must be an int in 1..{MAX_DECODE_QUERY_TOKENS}, "
                             f"got {t!r}")

    # -- what is asked --------------------------------------------------------------------------
    def requested(self) -> tuple[str, ...]:
        """The :data:`FEATURES` this value asks for, in that table's order."""
        asked = {
            self.kv_dtype: self.kv_dtype != "auto",
            "soft_cap": self.soft_cap is not None,
            "sink_logits": self.any_sinks,
            "layer_windows": self.layer_windows is not None and len(set(self.layer_windows)) > 1,
            "multi_token_decode": self.decode_query_tokens > 1,
        }
        return tuple(f for f in FEATURES if asked.get(f))

    def lacking(self, capability: str, supported: Collection[str]) -> tuple[str, ...]:
        """The requested features that reach ``capability`` (:data:`FEATURE_REACH`) and are not
        among ``supported`` (what a backend declares for it)."""
        return tuple(f for f in self.requested() if capability in FEATURE_REACH[f] and f not in supported)

    def __str__(self) -> str:
        parts = []
        if self.kv_dtype != "auto":
            parts.append(f"kv_dtype {self.kv_dtype}")
        if self.soft_cap is not None:
            parts.append(f"soft_cap {self.soft_cap:g}")
        if isinstance(self.sink_logits, tuple) and self.any_sinks and not all(self.sink_logits):
            parts.append(f"sink_logits on layers {[i for i, s in enumerate(self.sink_logits) if s]}")
        elif self.any_sinks:
            parts.append("sink_logits")
        if self.layer_windows is not None:
            parts.append(f"layer windows {sorted(set(self.layer_windows))}")
        if self.decode_query_tokens > 1:
            parts.append(f"{self.decode_query_tokens} query tokens per decode row")
        return ", ".join(parts) or "plain attention"

    # -- per layer ------------------------------------------------------------------------------
    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype K/V are stored in."""
        return KV_DTYPES[self.kv_dtype] or model_dtype

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    def check_layers(self, num_layers: int, who: str) -> None:
        """Per-layer values must name every layer: refused at build, naming the counts."""
        one = {"k_scale": "scale", "v_scale": "scale", "layer_windows": "window", "sink_logits": "bool"}
        for what, value in (("k_scale", self.k_scale), ("v_scale", self.v_scale),
                            ("layer_windows", self.layer_windows), ("sink_logits", self.sink_logits)):
            if isinstance(value, tuple) and len(value) != num_layers:
                raise InputError(f"{who}: features.{what} has {len(value)} entries, the model {num_layers} layers; "
                                 f"give one per layer (or one {one[what]} for all)")

    def scales(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of ``layer``."""
        k, v = self.k_scale, self.v_scale
        return (k[layer] if isinstance(k, tuple) else k, v[layer] if isinstance(v, tuple) else v)

    def window(self, layer: int, step_window: int) -> int:
        """``layer``'s window: its ``layer_windows`` entry, else the step's ``window_left``."""
        return step_window if self.layer_windows is None else self.layer_windows[layer]

    def windows(self, step_window: int) -> tuple[int, ...]:
        """The distinct windows a step uses, in first-layer order (one plan each)."""
        return (step_window,) if self.layer_windows is None else tuple(dict.fromkeys(self.layer_windows))

    def layer_plans(self) -> tuple[int, ...] | None:
        """Per layer, which of :meth:`windows`' plans it reads; None without per-layer windows
        (every layer reads the step's one plan)."""
        if self.layer_windows is None:
            return None
        windows = self.windows(-1)
        return tuple(windows.index(w) for w in self.layer_windows)

    def per_layer_count(self) -> int | None:
        """How many layers the per-layer ``layer_windows`` / ``sink_logits`` name; None: neither is
        given per layer."""
        if self.layer_windows is not None:
            return len(self.layer_windows)
        return len(self.sink_logits) if isinstance(self.sink_logits, tuple) else None

    @property
    def any_sinks(self) -> bool:
        """Whether some layer has sink logits."""
        return any(self.sink_logits) if isinstance(self.sink_logits, tuple) else self.sink_logits

    def layer_sinks(self, layer: int) -> bool:
        """Whether ``layer`` has sink logits."""
        return self.sink_logits[layer] if isinstance(self.sink_logits, tuple) else self.sink_logits

    def check_sinks(self, sinks: torch.Tensor | None, num_qo_heads: int, device: torch.device, who: str,
                    layer: int | None = None) -> None:
        """``sinks`` as ``run`` accepts them: a float tensor ``[num_qo_heads]`` on the cache's
        device exactly where the features ask for sink logits (per layer: ``layer``'s entry), None
        elsewhere."""
        if not isinstance(self.sink_logits, tuple):
            if sinks is None and self.sink_logits:
                # A plain softmax where the model has sink logits would be silently wrong.
                raise InputError(f"{who}: sinks not given, but the features ask for sink logits (sink_logits=True): "
                                 "pass this layer's sinks [num_qo_heads] to run(..., sinks=)")
            if sinks is not None and not self.sink_logits:
                raise InputError(f"{who}: sinks given, but the features do not ask for sink logits; build with "
                                 "AttentionFeatures(sink_logits=True) so selection picks a backend that supports them")
        elif layer is None:
            raise InputError(f"{who}: the features give each layer its sink logits (sink_logits per layer): run "
                             "needs layer_idx")
        elif sinks is None and self.sink_logits[layer]:
            raise InputError(f"{who}: sinks not given, but layer {layer} has sink logits (sink_logits[{layer}]=True): "
                             "pass this layer's sinks [num_qo_heads] to run(..., sinks=)")
        elif sinks is not None and not self.sink_logits[layer]:
            raise InputError(f"{who}: sinks given, but layer {layer} has no sink logits (sink_logits[{layer}]=False); "
                             "pass sinks=None for this layer, or build with True at this layer")
        if sinks is None:
            return
        check_sinks(sinks, num_qo_heads, device, who)


PLAIN = AttentionFeatures()
