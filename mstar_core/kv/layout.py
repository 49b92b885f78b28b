"""One label's rows of a paged plan, laid out: the stream values read once per row (plain
comprehensions), every per-row array computed with a few numpy operations straight into the one
page-locked buffer that goes to the device, and ``kv_indices`` gathered there from the page table.
No Python loop does arithmetic per row, and no host work grows with the context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from mstar_core.errors import StateError
from mstar_core.kv.page_table import PageTable
from mstar_core.kv.plan import LabelLayout, RowPack, SpanRows
from mstar_core.kv.streams import CacheStream
from mstar_core.step import KVSpan


class RowState(NamedTuple):
    """What a plan reads of each row's stream: its committed length, its pages held and its
    table row (int32 arrays), its generation and its page list itself. ``held`` None: the rows
    are kept ones (:class:`RowBatch`), whose pages the manager's own admit counted."""

    committed: np.ndarray
    held: np.ndarray | None
    table_row: np.ndarray
    generations: Sequence[int]
    sources: Sequence[Sequence[int]]


def row_state(streams: Sequence[CacheStream]) -> RowState:
    """The streams' :class:`RowState`: one plain pass per value, the only per-row Python work a
    plan does."""
    committed, held, table_row = np.array(([s.length for s in streams], [len(s.pages) for s in streams],
                                           [s.table_row for s in streams]), dtype=np.int32).reshape(3, len(streams))
    return RowState(committed, held, table_row, [s.generation for s in streams], [s.pages for s in streams])


def build_layout(table: PageTable, spans: Sequence[KVSpan], state: RowState, counts: Sequence[int] | int,
                 page_size: int, device: torch.device) -> LabelLayout:
    """The layout of ``spans`` (one label's, in packing order) over their admitted streams'
    ``state``; ``counts``: each span's tokens, or one int that every span has. Call
    ``table.prepare()`` first. The table's pending writes go to the device in the same copy."""
    ps = page_size
    rows = len(spans)
    committed, held, table_row = state.committed, state.held, state.table_row
    n: int | np.ndarray = counts if isinstance(counts, int) else np.array(counts, dtype=np.int32)
    decode = rows > 0 and (counts == 1 if isinstance(counts, int) else bool(np.all(n == 1)))
    cpu, a, at = table.stage(RowPack(rows, decode).size)
    pack = RowPack(rows, decode, at)
    lens, npages, last = pack.kv_lens(a), pack.num_pages(a), pack.last(a)
    qo, kvp = pack.qo(a), pack.kv_indptr(a)
    if decode:
        # one token per row, at position `committed`: its slot, its row's pages and last page's
        # tokens follow from one divmod
        slots, pos = pack.slots_and_positions(a)
        np.copyto(pos, committed)
        np.divmod(committed, ps, out=(npages, slots))
        npages += 1
        np.add(slots, 1, out=last)
        np.add(committed, 1, out=lens)
        np.copyto(qo, table.host_arange(rows + 1))
    else:
        np.add(committed, n, out=lens)
        np.add(lens, ps - 1, out=npages)
        np.floor_divide(npages, ps, out=npages)
        # the last page's tokens: (lens - 1) % ps + 1, and 0 for a row with no tokens (no pages)
        np.subtract(lens, 1, out=last)
        np.remainder(last, ps, out=last)
        last += 1
        np.minimum(last, lens, out=last)
        qo[0] = 0
        np.add.accumulate(np.broadcast_to(n, (rows,)), out=qo[1:])
    if held is not None and np.count_nonzero(npages > held):
        i = int(np.flatnonzero(npages > held)[0])
        raise StateError(f"plan before admit: stream ({spans[i].request_id!r}, {spans[i].label!r}) needs "
                         f"{int(npages[i])} pages, holds {int(held[i])}")
    kvp[0] = 0
    np.add.accumulate(npages, out=kvp[1:])
    page_base = pack.page_base(a)
    np.multiply(table_row, table.cols, out=page_base)
    if decode:
        np.subtract(kvp[1:], 1, out=pack.last_index(a))
    else:
        np.copyto(pack.table_base(a), page_base)
        np.subtract(committed, qo[:-1], out=pack.pos_base(a))
    page_base -= kvp[:-1]
    dev = table.send(cpu, at)
    total = int(kvp[-1])
    if table.on_host:  # host memory, copied by nobody asynchronously: views straight from numpy
        kv_indices = table.gather_host(npages, page_base, total)
        host = tuple(map(torch.from_numpy, (qo, kvp, last, lens)))
    else:
        kv_indices = table.gather(pack.kv_ends(dev), pack.page_base(dev), total)
        host = (pack.qo(cpu), pack.kv_indptr(cpu), pack.last(cpu), pack.kv_lens(cpu))
    return LabelLayout(
        rows=SpanRows(spans, state.generations, state.sources, lens, npages, qo),
        qo_indptr=host[0],
        kv_indptr=host[1],
        kv_indices=kv_indices,
        kv_last_page_len=host[2],
        kv_lens=host[3],
        page_size=ps,
        device=device,
        num_tokens=int(qo[-1]),
        decode=decode,
        table=table,
        rows_device=dev,
        pack=pack,
    )


class RowBatch:
    """A single-label step's rows kept across steps, as vLLM keeps its persistent batch: the
    streams, and their :class:`RowState` as arrays the manager updates in place (the pages a
    row gains at admit, the tokens it commits), so a decode loop over the same streams reads no
    stream attribute per row. Valid while the manager's ``epoch`` is the batch's: every other
    change to any stream moves the epoch on, and the next plan reads the streams again."""

    __slots__ = ("committed", "epoch", "generations", "in_flight", "keys", "slack", "sources", "streams",
                 "table_row")

    def __init__(self, keys: tuple[tuple[str, str], ...], streams: list[CacheStream], state: RowState,
                 page_size: int, epoch: int) -> None:
        assert state.held is not None
        self.keys, self.streams, self.epoch = keys, streams, epoch
        self.committed, self.table_row = state.committed, state.table_row
        # token slots free in each row's pages past its committed tokens: a row needs a page for
        # n more tokens where slack < n, and holds a page too many where slack >= page_size
        self.slack = state.held * page_size - state.committed
        # Shared with the plans made from them: replaced, never changed in place.
        self.generations, self.sources = state.generations, state.sources
        self.in_flight = True  # made by the plan of an admitted step

    def state(self) -> RowState:
        return RowState(self.committed, None, self.table_row, self.generations, self.sources)
