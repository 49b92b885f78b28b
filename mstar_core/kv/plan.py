"""The paged KV manager's plan: per-span layout and the FlashInfer-style arrays, per label."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mstar_core.errors import InputError, StateError, UnknownName
from mstar_core.kv.page_table import PageTable


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


class RowPack(NamedTuple):
    """Offsets of the per-row arrays in the one int32 array a plan stages (host and device):
    ``qo_indptr``, ``kv_indptr`` (rows + 1 each), then ``last_page_len``, ``kv_lens``,
    ``page_base`` (``table_row * cols - kv_indptr``: entry j of the step's ``kv_indices`` is
    ``table[page_base[row] + j]``), ``pos_base`` (``prefix_len - qo_indptr``: token t's position
    is ``pos_base[row] + t``) and ``table_base`` (``table_row * cols``), rows entries each; a
    decode step (one token per row) then has its per-token arrays, rows entries each: pages,
    slots, positions (:meth:`token_block`)."""

    rows: int
    decode: bool = False

    def qo(self, a: torch.Tensor) -> torch.Tensor:
        return a[: self.rows + 1]

    def kv_indptr(self, a: torch.Tensor) -> torch.Tensor:
        return a[self.rows + 1: 2 * self.rows + 2]

    def _field(self, a: torch.Tensor, i: int, k: int = 1) -> torch.Tensor:
        return a[2 * self.rows + 2 + i * self.rows: 2 * self.rows + 2 + (i + k) * self.rows]

    def last(self, a: torch.Tensor) -> torch.Tensor:
        return self._field(a, 0)

    def kv_lens(self, a: torch.Tensor) -> torch.Tensor:
        return self._field(a, 1)

    def page_base(self, a: torch.Tensor) -> torch.Tensor:
        return self._field(a, 2)

    def pos_base(self, a: torch.Tensor) -> torch.Tensor:
        return self._field(a, 3)

    def table_base(self, a: torch.Tensor) -> torch.Tensor:
        return self._field(a, 4)

    def token_block(self, a: torch.Tensor) -> torch.Tensor:
        """``[3, rows]``: a decode step's pages, slots and positions (one view)."""
        assert self.decode
        return self._field(a, 5, 3).view(3, self.rows)


def token_arrays(table: PageTable, pack: RowPack, dev: torch.Tensor, tokens: int,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per packed token, on the device (int32): its page, its slot in that page, its position,
    from the staged row arrays and the page table (a few kernels, no host loop over tokens). A
    decode step has them from the host instead (:meth:`RowPack.token_block`)."""
    t = table.arange(tokens)
    pos_base, table_base = table.spread(pack.qo(dev), tokens, pack.pos_base(dev), pack.table_base(dev))
    pos = pos_base + t
    page = table.table.index_select(0, table_base + pos // page_size)
    return page, pos % page_size, pos


@dataclass(frozen=True)
class LabelLayout:
    """One label's packed rows. Row arrays are int32 on the host (what FlashInfer's ``plan``
    wants); ``kv_indices``, write locations and positions are on the cache's device, built there
    from the persistent page table (:mod:`.page_table`): the host work of a plan grows with its
    rows, not with the context they hold.

    A decode step's per-token arrays are computed on the host (one page lookup per row) and come
    in the same copy; another eager step's are built on the device on first use, so a backend that
    never writes through the plan (the dense one) and a model that supplies its own positions
    never pay for them. A graph step has them in its slot's static buffers."""

    spans: tuple[SpanLayout, ...]
    qo_indptr: torch.Tensor  # [rows + 1] int32, on cpu
    kv_indptr: torch.Tensor  # [rows + 1] int32, on cpu
    kv_indices: torch.Tensor  # [pages] int32, on the cache's device
    kv_last_page_len: torch.Tensor  # [rows] int32, on cpu; 0 for a row with no pages
    kv_lens: torch.Tensor  # [rows] int32, on cpu
    page_size: int
    device: torch.device
    per_token: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    # what the lazy per-token arrays are built from: the page table, the staged rows on the device
    table: PageTable | None = field(default=None, compare=False, repr=False)
    rows_device: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def _token(self, name: str) -> torch.Tensor:
        if not self.per_token:
            if self.table is None or self.rows_device is None:
                raise StateError("this layout has no per-token arrays (built without the page table)")
            arrays = token_arrays(self.table, RowPack(len(self.spans)), self.rows_device, self.num_tokens,
                                  self.page_size)
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
        return torch.tensor(list(itertools.chain.from_iterable(s.source[: s.num_pages] for s in self.spans)),
                            dtype=torch.int32)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def q_lens(self) -> tuple[int, ...]:
        return tuple(s.to_compute for s in self.spans)


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
