"""Every stream's pages in one int32 table on the cache's device, kept across steps and updated by
delta, so that a step's page indices are built on the device from O(rows) host data.

The host keeps each stream's page list (``CacheStream.pages``, the truth); the table mirrors it:
row ``stream.table_row``, column i holds the stream's i-th page. Admit and fork record the pages
they append (:meth:`PageTable.write`); a plan sends the pending writes and the step's per-row
arrays to the device in one copy (:meth:`PageTable.upload`), applies the writes with one scatter
and gathers ``kv_indices`` (and, for a step that is not one token per row, the per-token
arrays) with a few kernels, whatever the context length (vLLM keeps a persistent block table
the same way). Entries past a stream's page count
are stale and never read, so releasing pages costs nothing on the device.

Ordering: every device operation here is issued on the current stream, in plan order, so a gather
for step N reads the table as step N's plan left it, whatever later plans write. A row is given
to another stream only once nothing in flight can still plan from it (:meth:`release`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar_core.errors import StateError

_I32_MAX = (1 << 31) - 1


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


class PageTable:
    """``[rows, cols]`` int32 on ``device`` (stored flat), grown by doubling; see the module
    docstring. ``cols`` never needs to exceed the cache's page count."""

    def __init__(self, device: torch.device, max_pages: int) -> None:
        self.device = device
        self.max_pages = max_pages
        self.rows = 0
        self.cols = 0
        self.table = torch.zeros(0, dtype=torch.int32, device=device)
        self._free_rows: list[int] = []
        self._next_row = 0
        # (row, col) -> page, in the order written: a later write to the same entry wins (a row
        # reused, or a stream truncated and grown again, before the next upload).
        self._writes: dict[tuple[int, int], int] = {}
        self._want_cols = 0
        self._arange = torch.arange(0, dtype=torch.int32, device=device)

    # -- host bookkeeping ------------------------------------------------------------------------
    def assign(self) -> int:
        """A free row for a stream that gets its first pages."""
        if self._free_rows:
            return self._free_rows.pop()
        self._next_row += 1
        return self._next_row - 1

    def release(self, row: int) -> None:
        """The stream that held ``row`` is gone and no step in flight plans from it."""
        if row >= 0:
            self._free_rows.append(row)

    def write(self, row: int, col: int, pages: Sequence[int]) -> None:
        """Pages ``pages`` now sit at columns ``col ..`` of ``row`` (sent at the next upload)."""
        w = self._writes
        for i, p in enumerate(pages):
            w[(row, col + i)] = p
        self._want_cols = max(self._want_cols, col + len(pages))

    def _grow(self) -> None:
        rows, cols = self.rows, self.cols
        if self._next_row > rows:
            rows = _pow2(self._next_row)
        if self._want_cols > cols:
            cols = min(_pow2(self._want_cols), max(self.max_pages, 1))
        if (rows, cols) == (self.rows, self.cols):
            return
        if rows * cols > _I32_MAX:
            raise StateError(f"page table of {rows} streams x {cols} pages exceeds int32 indexing")
        new = torch.zeros(rows * cols, dtype=torch.int32, device=self.device)
        if self.rows and self.cols:
            new.view(rows, cols)[: self.rows, : self.cols] = self.table.view(self.rows, self.cols)
        self.table, self.rows, self.cols = new, rows, cols

    # -- per step ------------------------------------------------------------------------------
    def prepare(self) -> int:
        """Size the table for every write recorded so far; returns ``cols`` (what a row's base
        offset ``row * cols`` in the flat table is computed with)."""
        self._grow()
        return self.cols

    def upload(self, host: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One copy to the device: the pending writes (as flat index, page) followed by ``host``
        (the caller's per-row arrays); applies the writes with one scatter. Returns ``host`` as an
        int32 CPU tensor and its device copy. Call :meth:`prepare` first (``host`` is computed
        with its ``cols``).

        The host side is a fresh page-locked tensor from torch's caching host allocator, copied
        asynchronously: the allocator does not hand that memory out again before the copy has
        run (it records an event on the stream), so a plan made while earlier steps are still
        queued needs no slot or fence of ours."""
        cols = self.cols
        writes = self._writes
        m = len(writes)
        values = [r * cols + c for r, c in writes] + list(writes.values()) + host if m else host
        if self.device.type == "cpu":
            dev = cpu = torch.tensor(values, dtype=torch.int32)
        else:
            cpu = torch.tensor(values, dtype=torch.int32, pin_memory=True)
            dev = cpu.to(self.device, non_blocking=True)
        if m:
            self.table.index_put_((dev[:m],), dev[m: 2 * m])
            writes.clear()
        return cpu[2 * m:], dev[2 * m:]

    def arange(self, n: int) -> torch.Tensor:
        """``0 .. n - 1`` int32 on the device (a view of a cached, grown buffer: no kernel)."""
        if self._arange.numel() < n:
            self._arange = torch.arange(_pow2(n, 1024), dtype=torch.int32, device=self.device)
        return self._arange[:n]

    def spread(self, indptr: torch.Tensor, n: int, *values: torch.Tensor) -> list[torch.Tensor]:
        """For each per-row array in ``values``, ``[n]`` int32 on the device: entry j holds the
        value of the row j falls in (``indptr``: the device copy, rows + 1 entries from 0,
        ``indptr[-1] == n``). A GPU finds the rows with one binary-search kernel; a CPU repeats
        each row's value (a binary search per entry is several times slower there)."""
        if self.device.type == "cpu":
            counts = indptr[1:] - indptr[:-1]
            return [torch.repeat_interleave(v, counts, output_size=n) for v in values]
        row = torch.searchsorted(indptr[1:], self.arange(n), right=True, out_int32=True)
        return [v.index_select(0, row) for v in values]

    def gather(self, kv_indptr: torch.Tensor, page_base: torch.Tensor, total: int) -> torch.Tensor:
        """``kv_indices`` ``[total]`` int32 on the device: entry j of row r is
        ``table[page_base[r] + j]``, ``page_base[r] = table_row * cols - kv_indptr[r]``."""
        if total == 0:
            return torch.zeros(0, dtype=torch.int32, device=self.device)
        (base,) = self.spread(kv_indptr, total, page_base)
        # index_select, not [] indexing: the same gather, several times faster on a CPU
        return self.table.index_select(0, base + self.arange(total))
