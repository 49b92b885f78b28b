"""The paged KV manager's plan: per-span layout and the FlashInfer-style arrays, per label."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from mstar_core.errors import InputError, StateError, UnknownName
from mstar_core.kv.page_table import PageTable
from mstar_core.step import KVSpan


class SpanLayout(NamedTuple):
    """Where one span's tokens live. ``length`` counts the stream's tokens after this step;
    this step's ``to_compute`` tokens sit at positions ``length - to_compute .. length - 1``
    and at packed offsets ``q_start .. q_start + to_compute - 1`` of their label. Its first
    ``num_pages`` pages (:attr:`pages`) hold them. (A NamedTuple: a plan makes one per row.)"""

    request_id: str
    label: str
    length: int
    to_compute: int
    commit: bool
    q_start: int
    generation: int
    num_pages: int
    # The stream's page list itself, not a copy (a plan is O(rows), not O(pages)). Its first
    # ``num_pages`` entries do not change once the plan is made: the manager only appends to a
    # stream's list, and where a commit drops pages (uncommitted tokens) it gives the stream a
    # new list. (A rollback cuts the list in place: the rolled-back plan is not read again.)
    source: Sequence[int] = ()

    @property
    def pages(self) -> tuple[int, ...]:
        """The stream's first ``num_pages`` pages (a tuple made on each call: O(pages))."""
        return tuple(self.source[: self.num_pages])

    @property
    def prefix_len(self) -> int:
        """Tokens already in the cache before this step."""
        return self.length - self.to_compute


# The per-token arrays of a layout, in the order they are staged.
TOKEN_ARRAYS = ("write_pages", "write_offsets", "positions")

# The per-row fields of a staged plan after its two indptrs, ``rows`` entries each, in order: the
# ones every plan stages, then a decode step's (one token per row) or another step's.
ROW_FIELDS = ("last", "kv_lens", "num_pages", "page_base")
DECODE_FIELDS = ("last_index", "write_offsets", "positions")
PREFILL_FIELDS = ("pos_base", "table_base")


class RowPack(NamedTuple):
    """Offsets of the per-row arrays in the one int32 array a plan stages (host and device), from
    entry ``at``: ``qo_indptr``, ``kv_indptr`` (rows + 1 each), then :data:`ROW_FIELDS`:
    ``last_page_len``, ``kv_lens``, pages per row, ``page_base`` (``table_row * cols -
    kv_indptr``: entry j of the step's ``kv_indices`` is ``table[page_base[row] + j]``). A decode
    step (one token per row) then has :data:`DECODE_FIELDS`: the index of each row's last page in
    ``kv_indices`` (where its one token goes), that token's slot and its position; another step
    :data:`PREFILL_FIELDS`: ``pos_base`` (``prefix_len - qo_indptr``: token t's position is
    ``pos_base[row] + t``) and ``table_base`` (``table_row * cols``), from which the per-token
    arrays are built on the device."""

    rows: int
    decode: bool = False
    at: int = 0

    @property
    def size(self) -> int:
        """Entries from ``at`` on."""
        extra = len(DECODE_FIELDS) if self.decode else len(PREFILL_FIELDS)
        return 2 * self.rows + 2 + (len(ROW_FIELDS) + extra) * self.rows

    def qo(self, a: Any) -> Any:
        return a[self.at: self.at + self.rows + 1]

    def kv_indptr(self, a: Any) -> Any:
        return a[self.at + self.rows + 1: self.at + 2 * self.rows + 2]

    def kv_ends(self, a: Any) -> Any:
        """``kv_indptr[1:]``: where each row's pages end."""
        return a[self.at + self.rows + 2: self.at + 2 * self.rows + 2]

    def _field(self, a: Any, i: int, k: int = 1) -> Any:
        start = self.at + 2 * self.rows + 2
        return a[start + i * self.rows: start + (i + k) * self.rows]

    def last(self, a: Any) -> Any:
        return self._field(a, 0)

    def kv_lens(self, a: Any) -> Any:
        return self._field(a, 1)

    def num_pages(self, a: Any) -> Any:
        return self._field(a, 2)

    def page_base(self, a: Any) -> Any:
        return self._field(a, 3)

    def last_index(self, a: Any) -> Any:
        assert self.decode
        return self._field(a, 4)

    def slots_and_positions(self, a: Any) -> Any:
        """``[2, rows]``: a decode step's token slots and positions (one view)."""
        assert self.decode
        return self._field(a, 5, 2).reshape(2, self.rows)

    def pos_base(self, a: Any) -> Any:
        assert not self.decode
        return self._field(a, 4)

    def table_base(self, a: Any) -> Any:
        assert not self.decode
        return self._field(a, 5)


def token_arrays(table: PageTable, pack: RowPack, dev: torch.Tensor, tokens: int,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per packed token, on the device (int32): its page, its slot in that page, its position,
    from the staged row arrays and the page table (a few kernels, no host loop over tokens). A
    decode step has slots and positions from the host instead (:meth:`RowPack.slots_and_positions`)."""
    t = table.arange(tokens)
    pos_base, table_base = table.spread(pack.qo(dev), tokens, pack.pos_base(dev), pack.table_base(dev))
    pos = pos_base + t
    page = table.table.index_select(0, table_base + pos // page_size)
    return page, pos % page_size, pos


def decode_token_arrays(pack: RowPack, dev: torch.Tensor,
                        kv_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's per-token arrays: each row's one token goes to its last page (an index
    into ``kv_indices``, staged), at the slot and position staged from the host."""
    slots, pos = pack.slots_and_positions(dev).unbind(0)
    return kv_indices.index_select(0, pack.last_index(dev)), slots, pos


class SpanRows(NamedTuple):
    """What a label's :class:`SpanLayout` rows are made from, kept as the plan found it (the
    stream values read at plan time, the staged host arrays) and turned into ``SpanLayout``
    objects only when read: a decode plan that nobody asks for its spans builds none."""

    spans: Sequence[KVSpan]  # the step's spans of this label, in packing order
    generations: Sequence[int]
    sources: Sequence[Sequence[int]]  # each stream's page list itself (see SpanLayout.source)
    lens: np.ndarray  # tokens per stream after the step (host, int32)
    num_pages: np.ndarray
    qo: np.ndarray  # qo_indptr (rows + 1)

    def build(self) -> tuple[SpanLayout, ...]:
        sp = self.spans
        return tuple(map(SpanLayout, [s.request_id for s in sp], [s.label for s in sp], self.lens.tolist(),
                         [s.num_tokens for s in sp], [s.commit for s in sp], self.qo[:-1].tolist(),
                         self.generations, self.num_pages.tolist(), self.sources))


@dataclass(frozen=True)
class LabelLayout:
    """One label's packed rows. Row arrays are int32 on the host (what FlashInfer's ``plan``
    wants); ``kv_indices``, write locations and positions are on the cache's device, built there
    from the persistent page table (:mod:`.page_table`): the host work of a plan grows with its
    rows, not with the context they hold.

    A decode step's slots and positions are computed on the host and come in the same copy, its
    pages from ``kv_indices`` on the device; another eager step's per-token arrays are built on
    the device on first use, so a backend that never writes through the plan (the dense one) and
    a model that supplies its own positions never pay for them. A graph step has them in its
    slot's static buffers. ``spans`` are built on first read (:class:`SpanRows`)."""

    rows: SpanRows = field(repr=False)
    qo_indptr: torch.Tensor  # [rows + 1] int32, on cpu
    kv_indptr: torch.Tensor  # [rows + 1] int32, on cpu
    kv_indices: torch.Tensor  # [pages] int32, on the cache's device
    kv_last_page_len: torch.Tensor  # [rows] int32, on cpu; 0 for a row with no pages
    kv_lens: torch.Tensor  # [rows] int32, on cpu
    page_size: int
    device: torch.device
    num_tokens: int = 0  # the step's tokens of this label (before any graph padding)
    decode: bool = False  # every row one token
    per_token: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    # what the lazy per-token arrays are built from: the page table, the staged rows on the device
    table: PageTable | None = field(default=None, compare=False, repr=False)
    rows_device: torch.Tensor | None = field(default=None, compare=False, repr=False)
    pack: RowPack | None = field(default=None, compare=False, repr=False)
    _built: dict[str, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def spans(self) -> tuple[SpanLayout, ...]:
        spans = self._built.get("spans")
        if spans is None:
            spans = self._built["spans"] = self.rows.build()
        return spans

    def _token(self, name: str) -> torch.Tensor:
        if not self.per_token:
            dev, pack = self.rows_device, self.pack
            if self.table is None or dev is None or pack is None:
                raise StateError("this layout has no per-token arrays (built without the page table)")
            arrays = (decode_token_arrays(pack, dev, self.kv_indices) if pack.decode
                      else token_arrays(self.table, pack, dev, self.num_tokens, self.page_size))
            self.per_token.update(zip(TOKEN_ARRAYS, arrays, strict=True))
        return self.per_token[name]

    @property
    def write_pages(self) -> torch.Tensor:
        """``[tokens]`` int32 on the device: the page of each packed token."""
        return self._token("write_pages")

    @property
    def write_offsets(self) -> torch.Tensor:
        """``[tokens]`` int32 on the device: its slot within that page."""
        return self._token("write_offsets")

    @property
    def positions(self) -> torch.Tensor:
        """``[tokens]`` int32 on the device: its position in its stream."""
        return self._token("positions")

    @property
    def kv_indices_host(self) -> torch.Tensor:
        """``kv_indices`` as an int32 host tensor, from the host page lists (O(pages), no device
        sync): for a consumer that does host arithmetic on the pages (the mixed wrapper's split)."""
        r = self.rows
        return torch.tensor(list(itertools.chain.from_iterable(
            src[:n] for src, n in zip(r.sources, r.num_pages.tolist(), strict=True))), dtype=torch.int32)

    @property
    def q_lens(self) -> tuple[int, ...]:
        return tuple(s.num_tokens for s in self.rows.spans)


@dataclass(frozen=True)
class KVPlan:
    """Per-label layouts of one step, labels in first-appearance order."""

    labels: tuple[tuple[str, LabelLayout], ...]
    page_size: int

    def layout(self, label: str | None = None) -> LabelLayout:
        """The layout of ``label``; ``None`` is allowed when the step has exactly one label."""
        if label is None:
            if len(self.labels) != 1:
                names = [n for n, _ in self.labels]
                raise InputError(f"label=None is ambiguous: this step has labels {names}; name one")
            return self.labels[0][1]
        for name, lay in self.labels:
            if name == label:
                return lay
        raise UnknownName(f"label {label!r} is not in this step; its labels are {[n for n, _ in self.labels]}")

    @property
    def spans(self) -> tuple[SpanLayout, ...]:
        return tuple(s for _, lay in self.labels for s in lay.spans)
