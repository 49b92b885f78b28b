"""The bounded step part: which requests a step runs, at which stream positions, with which
prefix source.

A step carries it as ``Step(kv=..., extra=(("bounded", BoundedStep(...)),))``;
``BoundedKVManager`` reads ``step.part("bounded")``. A step without that part falls back to its
``kv`` spans (one span per request: ``num_tokens`` and ``commit`` from the span, no source).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....step import Step
from ....kernels.bounded_attention.table import NO_SOURCE, ROW_SOURCE

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
        if self.num_tokens < 0:
            raise ValueError(f"StreamPosition({self.request_id!r}): num_tokens must be >= 0, got {self.num_tokens}")
        if self.source is not None and self.source < ROW_SOURCE:
            raise ValueError(f"StreamPosition({self.request_id!r}): source must be None, -1 or >= 0, got {self.source}")
        if self.source_len is not None and self.source_len < 0:
            raise ValueError(f"StreamPosition({self.request_id!r}): source_len must be >= 0, got {self.source_len}")

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
        ids = [p.request_id for p in self.positions]
        if len(ids) != len(set(ids)):
            raise ValueError(f"BoundedStep: a request appears more than once: {ids}")

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(p.request_id for p in self.positions)


def bounded_part(step: Step) -> BoundedStep:
    """The step's bounded part, or one derived from its kv spans."""
    part = step.part(PART)
    if part is not None:
        if not isinstance(part, BoundedStep):
            raise TypeError(f"step part {PART!r} must be a BoundedStep, got {type(part).__name__}")
        return part
    try:
        return BoundedStep(tuple(StreamPosition(s.request_id, s.num_tokens, commit=s.commit) for s in step.kv.spans))
    except ValueError as e:
        raise ValueError(f"step has no {PART!r} part and its kv spans do not name one span per request: {e}") from None
