"""Every stream's pages in one int32 table on the cache's device, kept across steps and updated by
delta, so that a step's page indices are built on the device from O(rows) host data.

The host keeps each stream's page list (``CacheStream.pages``, the truth); the table mirrors it:
row ``stream.table_row``, column i holds the stream's i-th page. Admit and fork record the pages
they append (:meth:`PageTable.write`); a plan sends the pending writes and the step's per-row
arrays to the device in one copy (:meth:`PageTable.stage`, :meth:`PageTable.send`), applies the writes with one scatter
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

import numpy as np
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
        # On a CPU the table is host memory, written and read through numpy (a torch op costs
        # more there than its arithmetic); a test may set it False to run the accelerator path.
        self.on_host = device.type == "cpu"
        self._np: np.ndarray | None = None
        self._np_arange = np.arange(0, dtype=np.int32)

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
        self._np = None

    # -- per step ------------------------------------------------------------------------------
    def prepare(self) -> int:
        """Size the table for every write recorded so far; returns ``cols`` (what a row's base
        offset ``row * cols`` in the flat table is computed with)."""
        self._grow()
        return self.cols

    def stage(self, n: int) -> tuple[torch.Tensor, np.ndarray, int]:
        """A fresh host int32 buffer with room for ``n`` entries from entry ``at`` (the caller's
        per-row arrays, written through the numpy view); :meth:`send` puts it on the device.
        Returns ``(buffer, its numpy view, at)``. Call :meth:`prepare` first (the pending writes'
        flat indices use its ``cols``).

        On an accelerator the pending writes lead the buffer (``m`` flat indices, then their ``m``
        pages: ``at = 2 * m``) and go in the same copy. The buffer is page-locked, from torch's
        caching host allocator, and copied asynchronously: the allocator does not hand that memory
        out again before the copy has run (it records an event on the stream), so a plan made while
        earlier steps are still queued needs no slot or fence of ours. On a CPU (:attr:`on_host`)
        the table is host memory: the writes land in it here, through numpy, and ``at = 0``."""
        writes = self._writes
        m = len(writes)
        cols = self.cols
        if self.on_host:
            if m:
                self._host_table()[[r * cols + c for r, c in writes]] = list(writes.values())
                writes.clear()
            a = np.empty(n, dtype=np.int32)
            return torch.from_numpy(a), a, 0
        cpu = torch.empty(2 * m + n, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        a = cpu.numpy()
        if m:
            a[:m] = [r * cols + c for r, c in writes]
            a[m: 2 * m] = list(writes.values())
        return cpu, a, 2 * m

    def send(self, cpu: torch.Tensor, at: int) -> torch.Tensor:
        """``cpu`` (from :meth:`stage`) on the device, in one copy, and the writes it leads with
        (``at // 2`` of them) applied to the table with one scatter. Returns the device copy
        (``cpu`` itself on a CPU)."""
        if self.on_host:
            return cpu
        dev = cpu.to(self.device, non_blocking=True)
        if at:
            m = at // 2
            self.table.index_put_((dev[:m],), dev[m:at])
            self._writes.clear()
        return dev

    def _host_table(self) -> np.ndarray:
        """The table as a numpy view (on a CPU, where it is host memory)."""
        if self._np is None or self._np.shape[0] != self.table.numel():
            self._np = self.table.numpy()
        return self._np

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
        if self.on_host:
            counts = indptr[1:] - indptr[:-1]
            return [torch.repeat_interleave(v, counts, output_size=n) for v in values]
        row = torch.searchsorted(indptr[1:], self.arange(n), right=True, out_int32=True)
        return [v.index_select(0, row) for v in values]

    def gather(self, kv_ends: torch.Tensor, page_base: torch.Tensor, total: int) -> torch.Tensor:
        """``kv_indices`` ``[total]`` int32 on the device: entry j of row r is
        ``table[page_base[r] + j]``, ``page_base[r] = table_row * cols - kv_indptr[r]``
        (``kv_ends``: ``kv_indptr[1:]``, both on the device): one binary search finds each
        entry's row."""
        if total == 0:
            return torch.zeros(0, dtype=torch.int32, device=self.device)
        entries = self.arange(total)
        row = torch.searchsorted(kv_ends, entries, right=True, out_int32=True)
        return self.table.index_select(0, page_base.index_select(0, row) + entries)

    def gather_host(self, num_pages: np.ndarray, page_base: np.ndarray, total: int) -> torch.Tensor:
        """:meth:`gather` on a CPU, from the host arrays (``num_pages``: each row's pages), in
        numpy: each row's base repeated over its pages, then one take from the table."""
        idx = np.repeat(page_base, num_pages)
        idx += self.host_arange(total)
        return torch.from_numpy(self._host_table().take(idx))

    def host_arange(self, n: int) -> np.ndarray:
        """``0 .. n - 1`` int32 on the host (a view of a cached, grown array)."""
        if self._np_arange.shape[0] < n:
            self._np_arange = np.arange(_pow2(n, 1024), dtype=np.int32)
        return self._np_arange[:n]
