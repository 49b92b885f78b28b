"""Geometry of a bounded KV cache, and one request's layout within a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mstar_core.errors import InputError, InputTypeError
from mstar_core.step import is_int


@dataclass(frozen=True)
class BoundedKVConfig:
    """``max_slots`` slots, each ``rows`` parallel streams (e.g. an audio model's codebooks) of
    ``num_heads`` KV heads keeping ``sink`` first tokens and a ring of the last ``window``.

    ``num_heads`` counts KV heads; queries may have any multiple of it (grouped-query attention,
    decided by ``q``'s shape at ``attend``). ``query_window`` (``<= window``, None: none) limits
    each query to keys at distance ``<= query_window`` besides the sinks (see
    :mod:`mstar_core.kernels.bounded_attention`)."""

    num_layers: int
    max_slots: int
    rows: int
    num_heads: int
    head_dim: int
    sink: int
    window: int
    query_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "max_slots", "rows", "num_heads", "head_dim", "sink", "window", "query_window"):
            value = getattr(self, name)
            if value is None and name == "query_window":
                continue
            if not is_int(value):
                raise InputTypeError(f"BoundedKVConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, int(value))  # e.g. a numpy integer: stored as int
        for name in ("num_layers", "max_slots", "rows", "num_heads", "head_dim", "window"):
            if getattr(self, name) < 1:
                raise InputError(f"BoundedKVConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.sink < 0:
            raise InputError(f"BoundedKVConfig.sink must be >= 0, got {self.sink}")
        qw = self.query_window
        if qw is not None and not 0 <= qw <= self.window:
            # A wider query window would need keys the ring has already overwritten.
            raise InputError(f"BoundedKVConfig.query_window must be in [0, window={self.window}], got {qw}")

    @property
    def cap(self) -> int:
        """Keys a slot row holds: ``sink + window``."""
        return self.sink + self.window

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        """``[max_slots, rows, H, cap, 2D]``: K and V side by side in the last dim."""
        return (self.max_slots, self.rows, self.num_heads, self.cap, 2 * self.head_dim)

    @property
    def slot_elements(self) -> int:
        """Elements one slot holds in one layer (times the element size: bytes)."""
        return self.rows * self.num_heads * self.cap * 2 * self.head_dim

    def row_layout(self, start: int, num_tokens: int, source_len: int = 0, commit: bool = True) -> RowLayout:
        """The layout of a request whose step covers positions ``start .. start + num_tokens - 1``."""
        return RowLayout(
            start=start,
            num_tokens=num_tokens,
            sink_kept=min(start, self.sink),
            ring_kept=min(max(start - self.sink, 0), self.window),
            source_len=source_len,
            commit=commit,
        )


class RowLayout(NamedTuple):
    """One request's place in a step (the same for each of its ``rows``).

    ``sink_kept + ring_kept`` keys are retained before the step; ``source_len`` prefix keys are
    read from its source (-1: the source's whole length); ``commit=False`` attends without
    writing the step's keys or advancing the stream."""

    start: int
    num_tokens: int
    sink_kept: int
    ring_kept: int
    source_len: int
    commit: bool

    @property
    def retained(self) -> int:
        return self.sink_kept + self.ring_kept

    @property
    def end(self) -> int:
        """Stream length after the step, if committed."""
        return self.start + self.num_tokens
