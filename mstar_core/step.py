"""The step declaration and the per-step context every resource reads and writes.

A step declares, per resource kind, what it does; each resource reads only its part. Plans are
immutable values stored in :class:`StepContext.plan_results` under the resource's name; the
runner never looks inside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KVSpan:
    """``num_tokens`` new tokens of stream ``(request_id, label)`` in this step.

    ``commit=False`` tokens are computed but not kept: the stream's committed length does not
    move and the pages held only for them are released at commit (seed 000's fresh tokens).
    """

    request_id: str
    label: str
    num_tokens: int
    commit: bool = True

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"KVSpan({self.request_id!r}, {self.label!r}): num_tokens must be >= 0, got {self.num_tokens}")


@dataclass(frozen=True)
class KVStep:
    """The KV part of a step: its spans, in packing order."""

    spans: tuple[KVSpan, ...]

    def __post_init__(self) -> None:
        seen: set[tuple[str, str]] = set()
        for s in self.spans:
            key = (s.request_id, s.label)
            if key in seen:
                # One span per stream per step keeps `length` and `to_compute` unambiguous.
                raise ValueError(f"KVStep: stream {key} appears in more than one span")
            seen.add(key)

    @property
    def labels(self) -> tuple[str, ...]:
        """Labels in first-appearance order."""
        return tuple(dict.fromkeys(s.label for s in self.spans))

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.request_id for s in self.spans))

    def keys(self) -> tuple[tuple[str, str], ...]:
        """The ``(request_id, label)`` streams this step touches, in packing order."""
        return tuple((s.request_id, s.label) for s in self.spans)


@dataclass(frozen=True)
class AttentionStep:
    """The attention part of a step: the mask the layers of this step use.

    ``window_left`` is the number of preceding positions each query sees (-1: unbounded);
    ``sm_scale`` None means ``1/sqrt(head_dim)``.
    """

    causal: bool = True
    window_left: int = -1
    sm_scale: float | None = None


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
    """The answer of ``admit``: admitted, or refused with what is short. Never an exception."""

    admitted: bool
    shortages: tuple[Shortage, ...] = ()

    @classmethod
    def ok(cls) -> AdmitOutcome:
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
