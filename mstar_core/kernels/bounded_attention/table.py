"""The int table a bounded-attention call reads: one row per request of the step, int32.

The bounded KV manager's ``plan`` builds it on the host; both kernels (reference and Triton)
read it on the device, so a captured graph replays whatever the latest plan copied in.
"""

from __future__ import annotations

# Columns of the table, in order.
SLOT = 0  # the request's slot in the cache
START = 1  # stream position of the step's first token (= tokens committed before the step)
NUM_TOKENS = 2  # this step's tokens of the request (<= T; queries beyond it are padding)
SINK_KEPT = 3  # sink keys retained before the step: min(start, sink)
RING_KEPT = 4  # ring keys retained before the step: min(max(start - sink, 0), window)
SOURCE = 5  # >= 0: index into ``source``; ROW_SOURCE: read ``row_source``; NO_SOURCE: none
SOURCE_LEN = 6  # prefix keys read from the source; ALL_SOURCE: the source's whole length L
WRITE = 7  # 1: write this step's keys into the slot after attending; 0: attend only
NUM_COLS = 8

ROW_SOURCE = -1
NO_SOURCE = -2
ALL_SOURCE = -1

# A table row that does nothing: no tokens, no keys, no write. Graph buffers are padded with it
# so a replay captured for a larger batch leaves the extra requests untouched.
NOOP_ROW = (0, 0, 0, 0, 0, NO_SOURCE, 0, 0)
