"""The step declaration and the per-step context every resource reads and writes.

A step declares, per resource kind, what it does; each resource reads only its part. Plans are
immutable values stored in :class:`StepContext.plan_results` under the resource's name; the
runner never looks inside them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeGuard

import torch

from mstar_core.errors import InputError, InputTypeError


def is_int(value: Any) -> TypeGuard[int]:
    """An integer (a numpy integer too), not a bool: what every count and index here accepts."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def elements(value: Any) -> Any:
    """A tensor's or numpy array's elements as a (nested) list, for the checks that take a list
    of ints; anything else (a numpy scalar too) as it is."""
    if isinstance(value, torch.Tensor) or type(value).__name__ == "ndarray" and hasattr(value, "tolist"):
        return value.tolist()
    return value


def as_count(value: Any, what: str) -> int:
    """``value`` as a plain ``int >= 0``, or an error naming it: a bool, a float, a string or a
    tensor is refused (a 0-d tensor would make lengths tensors; ``2.0`` would reach the page
    pool half-way through an admit)."""
    if not is_int(value):
        raise InputTypeError(f"{what} must be an int >= 0, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise InputError(f"{what} must be >= 0, got {value}")
    return int(value)


# What a scale, soft-cap or sm_scale may be: kernels compute in float32, where a value below its
# smallest normal number (a denormal, or less) flushes products to 0 and one above its largest is inf.
SCALE_MIN, SCALE_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
SCALE_RANGE = f"a finite float > 0, within float32's normal range {SCALE_MIN:.4g} .. {SCALE_MAX:.4g}"


def is_positive_finite(value: Any) -> bool:
    """A real number (not a bool), finite and > 0 and within float32's normal range
    (:data:`SCALE_RANGE`): what every scale, soft-cap and sm_scale is."""
    # float(): numbers.Real declares no ">"; isfinite converts to float already.
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and SCALE_MIN <= float(value) <= SCALE_MAX)


def check_window_and_scale(who: str, window_left: Any, sm_scale: Any) -> None:
    """A step's mask parameters, checked where they enter (``AttentionStep``, the wrappers'
    ``plan``): ``window_left`` an int >= -1, ``sm_scale`` None or a finite float > 0."""
    if not is_int(window_left) or window_left < -1:
        raise InputError(f"{who}: window_left must be an int >= 0, or -1 for no window; got {window_left!r}")
    if sm_scale is not None and not is_positive_finite(sm_scale):
        raise InputError(f"{who}: sm_scale must be {SCALE_RANGE}, or None for 1/sqrt(head_dim); got {sm_scale!r}")


def _check_str(value: Any, what: str) -> None:
    if not isinstance(value, str):
        raise InputTypeError(f"{what} must be a str, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class KVSpan:
    """``num_tokens`` new tokens of stream ``(request_id, label)`` in this step.

    ``commit=False`` tokens are computed but not kept: the stream's committed length does not
    move and the pages held only for them are released at commit (the dense path's fresh tokens).
    """

    request_id: str
    label: str
    num_tokens: int
    commit: bool = True

    def __post_init__(self) -> None:
        # Validated here, at the boundary: an admit never starts on a span it cannot finish.
        _check_str(self.request_id, "KVSpan.request_id")
        _check_str(self.label, "KVSpan.label")
        who = f"KVSpan({self.request_id!r}, {self.label!r})"
        object.__setattr__(self, "num_tokens", as_count(self.num_tokens, f"{who}: num_tokens"))
        if not isinstance(self.commit, bool):
            raise InputTypeError(f"{who}: commit must be a bool, got {self.commit!r}")


@dataclass(frozen=True)
class KVStep:
    """The KV part of a step: its spans, in packing order."""

    spans: tuple[KVSpan, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "spans", tuple(self.spans))
        seen: set[tuple[str, str]] = set()
        for s in self.spans:
            if not isinstance(s, KVSpan):
                raise InputTypeError(f"KVStep: spans must be KVSpan, got {s!r} ({type(s).__name__})")
            key = (s.request_id, s.label)
            if key in seen:
                # One span per stream per step keeps `length` and `to_compute` unambiguous.
                raise InputError(f"KVStep: stream {key} appears in more than one span")
            seen.add(key)

    # What admit, plan and commit ask of the spans, computed once per step (the spans never
    # change) and then read as plain attributes: a decode loop that reuses its step object pays
    # each per-span pass once, not on every step.
    @cached_property
    def labels(self) -> tuple[str, ...]:
        """Labels in first-appearance order."""
        return tuple(dict.fromkeys(s.label for s in self.spans))

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.request_id for s in self.spans))

    @cached_property
    def _keys(self) -> tuple[tuple[str, str], ...]:
        return tuple((s.request_id, s.label) for s in self.spans)

    def keys(self) -> tuple[tuple[str, str], ...]:
        """The ``(request_id, label)`` streams this step touches, in packing order."""
        return self._keys

    @cached_property
    def token_counts(self) -> tuple[int, ...]:
        """Each span's ``num_tokens``, in packing order."""
        return tuple(s.num_tokens for s in self.spans)

    @cached_property
    def uniform_tokens(self) -> int | None:
        """The ``num_tokens`` every span has (1: a decode step), or None where they differ or
        there are no spans."""
        counts = self.token_counts
        return counts[0] if counts and counts.count(counts[0]) == len(counts) else None

    @cached_property
    def all_commit(self) -> bool:
        """Whether every span keeps its tokens (``commit=True``)."""
        return all(s.commit for s in self.spans)

    @cached_property
    def label_rows(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(label, indices of its spans)`` per label, labels in first-appearance order."""
        rows: dict[str, list[int]] = {}
        for i, s in enumerate(self.spans):
            rows.setdefault(s.label, []).append(i)
        return tuple((label, tuple(idx)) for label, idx in rows.items())


@dataclass(frozen=True)
class AttentionStep:
    """The attention part of a step: the mask the layers of this step use.

    ``window_left`` is the number of preceding positions each query sees (-1: unbounded);
    ``sm_scale`` None means ``1/sqrt(head_dim)``.
    """

    causal: bool = True
    window_left: int = -1
    sm_scale: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise InputTypeError(f"AttentionStep: causal must be a bool, got {self.causal!r}")
        check_window_and_scale("AttentionStep", self.window_left, self.sm_scale)
        object.__setattr__(self, "window_left", int(self.window_left))
        if self.sm_scale is not None:
            object.__setattr__(self, "sm_scale", float(self.sm_scale))


@dataclass(frozen=True)
class Step:
    """One step's declaration: one part per resource kind (None where the step has none)."""

    kv: KVStep
    attn: AttentionStep = AttentionStep()
    extra: tuple[tuple[str, Any], ...] = ()  # further resource kinds' parts, by kind name

    def part(self, kind: str) -> Any:
        """The part named ``kind`` (``"kv"``, ``"attn"`` or one of ``extra``), None if absent."""
        if kind == "kv":
            return self.kv
        if kind == "attn":
            return self.attn
        return dict(self.extra).get(kind)


@dataclass
class StepContext:
    """Mutable per-step state: plans by resource name, and what each resource's admit took.

    ``admitted`` lets ``rollback_admit`` undo exactly this step's reservations without the
    resource keeping per-step state of its own.
    """

    plan_results: dict[str, Any] = field(default_factory=dict)
    admitted: dict[str, Any] = field(default_factory=dict)
    step_index: int = 0
    # Graph replay: plan into staging slot ``slot`` and pad the step's rows to ``bucket``
    # (a captured batch size). None: an eager step, planned into fresh tensors.
    slot: int = 0
    bucket: int | None = None
    # Graph replay of multi-token decode (speculative verification): every row has this many
    # query tokens, so the step's tokens are padded to ``bucket * query_tokens``.
    query_tokens: int = 1

    @property
    def graph_tokens(self) -> int | None:
        """The token count a graph step is padded to (None: eager)."""
        return None if self.bucket is None else self.bucket * self.query_tokens


@dataclass(frozen=True)
class Shortage:
    """What an admit is short of: ``needed`` of ``what`` against ``available``."""

    resource: str
    what: str
    needed: int
    available: int
    request_id: str | None = None

    def __str__(self) -> str:
        who = f" for request {self.request_id!r}" if self.request_id else ""
        return f"{self.resource}: needs {self.needed} {self.what}{who}, {self.available} free"


@dataclass(frozen=True)
class AdmitOutcome:
    """The answer of ``admit``: admitted, or refused with what is short. Never an exception.
    ``cached_tokens``: what :meth:`~mstar_core.kv.KVManager.admit_prefix` found in the prefix
    cache (0 elsewhere)."""

    admitted: bool
    shortages: tuple[Shortage, ...] = ()
    cached_tokens: int = 0

    @classmethod
    def ok(cls) -> AdmitOutcome:
        # one shared value (the outcome is frozen): every resource of every step answers it
        if cls is AdmitOutcome:
            return _OK
        return cls(True)

    @classmethod
    def refuse(cls, *shortages: Shortage) -> AdmitOutcome:
        return cls(False, tuple(shortages))

    def __bool__(self) -> bool:
        return self.admitted

    def reason(self, most: int = 4) -> str:
        """One line; past ``most`` shortages the rest are counted, not listed."""
        if self.admitted:
            return "admitted"
        head = "; ".join(str(s) for s in self.shortages[:most])
        rest = len(self.shortages) - most
        return head + (f"; and {rest} more" if rest > 0 else "")


_OK = AdmitOutcome(True)
