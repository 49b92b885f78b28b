"""The bounded step part: which requests a step runs, at which stream positions, with which
prefix source.

A step carries it as ``Step(kv=..., extra=(("bounded", BoundedStep(...)),))``;
``BoundedKVManager`` reads ``step.part("bounded")``. A step without that part falls back to its
``kv`` spans (one span per request: ``num_tokens`` and ``commit`` from the span, no source).
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar_core.errors import InputError, InputTypeError
from mstar_core.kernels.bounded_attention.table import NO_SOURCE, ROW_SOURCE
from mstar_core.step import Step, is_int

PART = "bounded"  # the step part's kind name


@dataclass(frozen=True)
class StreamPosition:
    """One request's tokens in a step.

    ``start`` is the stream position of the first token; None means "where the stream is"
    (its committed length), and a given value must equal it — the manager checks, so a step
    built from a stale view of the stream fails loudly instead of reading the wrong keys.
    ``source``: None, no prefix; ``k >= 0``, prefix ``k`` of ``attend``'s ``source``; -1, the
    request's entry of ``attend``'s ``row_source``. ``source_len`` keys of it are read (None:
    all). ``commit=False`` attends without writing the step's keys or advancing the stream (e.g.
    repeated denoise passes over the same positions)."""

    request_id: str
    num_tokens: int
    start: int | None = None
    source: int | None = None
    source_len: int | None = None
    commit: bool = True

    def __post_init__(self) -> None:
        who = f"StreamPosition({self.request_id!r})"
        if not isinstance(self.request_id, str):
            raise InputTypeError(f"{who}: request_id must be a str, "
                                 f"got {type(self.request_id).__name__} {self.request_id!r}")
        _set_int(self, who, "num_tokens", low=0, what=">= 0")
        _set_int(self, who, "start", low=0, what="None or >= 0", optional=True)
        _set_int(self, who, "source", low=ROW_SOURCE, what="None, -1 (row source) or >= 0", optional=True)
        _set_int(self, who, "source_len", low=0, what="None or >= 0", optional=True)
        if not isinstance(self.commit, bool):
            raise InputTypeError(f"{who}: commit must be a bool, got {type(self.commit).__name__} {self.commit!r}")

    @property
    def source_code(self) -> int:
        """The table's SOURCE value."""
        return NO_SOURCE if self.source is None else self.source


@dataclass(frozen=True)
class BoundedStep:
    """The bounded part of a step: its requests in batch order (row ``b * rows + r`` of
    ``attend``'s tensors is request ``b``'s stream ``r``)."""

    positions: tuple[StreamPosition, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.positions, (tuple, list)):
            raise InputTypeError(f"BoundedStep: positions must be a tuple of StreamPosition, "
                                 f"got {type(self.positions).__name__}")
        object.__setattr__(self, "positions", tuple(self.positions))  # a list is taken, stored as a tuple
        for i, p in enumerate(self.positions):
            if not isinstance(p, StreamPosition):
                raise InputTypeError(f"BoundedStep: positions[{i}] must be a StreamPosition, "
                                     f"got {type(p).__name__} {p!r}")
        ids = [p.request_id for p in self.positions]
        if len(ids) != len(set(ids)):
            raise InputError(f"BoundedStep: a request appears more than once: {ids}")

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(p.request_id for p in self.positions)


def bounded_part(step: Step) -> BoundedStep:
    """The step's bounded part, or one derived from its kv spans."""
    if not isinstance(step, Step):
        raise InputTypeError(f"expected a Step, got {type(step).__name__}")
    part = step.part(PART)
    if part is not None:
        if not isinstance(part, BoundedStep):
            raise InputTypeError(f"step part {PART!r} must be a BoundedStep, got {type(part).__name__}")
        return part
    ids = [s.request_id for s in step.kv.spans]
    if len(ids) != len(set(ids)):
        raise InputError(f"step has no {PART!r} part and its kv spans do not name one span per request: "
                         f"request ids {ids}")
    return BoundedStep(tuple(StreamPosition(s.request_id, s.num_tokens, commit=s.commit) for s in step.kv.spans))


def _set_int(obj: object, who: str, name: str, low: int, what: str, optional: bool = False) -> None:
    """Check that field ``name`` is an integer ``>= low`` and store it as a plain ``int`` (a numpy
    integer is taken; a bool, a float, a string or a tensor is not: a 0-d tensor would make
    lengths tensors); ``optional`` allows None."""
    value = getattr(obj, name)
    if value is None and optional:
        return
    if not is_int(value):
        raise InputTypeError(f"{who}: {name} must be {'None or ' if optional else ''}an int, "
                             f"got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low:
        raise InputError(f"{who}: {name} must be {what}, got {value}")
    object.__setattr__(obj, name, value)
