"""``BoundedPlan``: a step's layout, as an int table on the device and its host mirror."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mstar_core.kernels.bounded_attention import table as tb
from mstar_core.kv.bounded.config import RowLayout


class BoundedPlan(NamedTuple):
    """One step's layout.

    ``table`` ``[B, NUM_COLS]`` int32 on the device (columns in
    :mod:`mstar_core.kernels.bounded_attention.table`) is what the kernels read; ``rows`` is its
    host mirror, ``(slot, layout, source)`` per request in batch order (``source``: the table's
    SOURCE code, -1 row source, -2 none). ``max_retained`` bounds the retained keys of any
    request, ``max_span`` its tokens this step (the ``T`` the step's tensors must cover);
    ``reads_source`` / ``reads_row_source`` say whether ``attend`` needs ``source`` /
    ``row_source``. ``owners`` is ``(request_id, epoch)`` per row, as the step's admit recorded
    them: ``attend`` marks a row's slot as written-but-uncommitted only while that request still
    holds the slot in that epoch (not reset or removed since), so a mark never outlives the
    request. Rows past ``owners`` (padding) are never marked. ``admits`` numbers each owner's
    admit: a plan lives only while its own admit is in flight, not a later step's of the same
    request."""

    table: torch.Tensor
    rows: tuple[tuple[int, RowLayout, int], ...]
    max_retained: int
    max_span: int
    reads_source: bool
    reads_row_source: bool
    owners: tuple[tuple[str, int], ...] = ()
    admits: tuple[int, ...] = ()

    def retained(self) -> torch.Tensor:
        """Each row's retained keys before its step, ``[rows]`` int32 on the device."""
        return self.table[:, tb.SINK_KEPT] + self.table[:, tb.RING_KEPT]

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def request_slots(self) -> tuple[int, ...]:
        return tuple(slot for slot, _, _ in self.rows)


def host_table(rows: tuple[tuple[int, RowLayout, int], ...]) -> torch.Tensor:
    """The ``[B, NUM_COLS]`` int32 table of ``rows``, on the host."""
    data = []
    for slot, lay, source in rows:
        vals = [0] * tb.NUM_COLS
        vals[tb.SLOT] = slot
        vals[tb.START] = lay.start
        vals[tb.NUM_TOKENS] = lay.num_tokens
        vals[tb.SINK_KEPT] = lay.sink_kept
        vals[tb.RING_KEPT] = lay.ring_kept
        vals[tb.SOURCE] = source
        vals[tb.SOURCE_LEN] = lay.source_len if source != tb.NO_SOURCE else 0
        vals[tb.WRITE] = int(lay.commit)
        data.append(vals)
    return torch.tensor(data, dtype=torch.int32).view(len(rows), tb.NUM_COLS)
