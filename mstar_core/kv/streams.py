"""``CacheStream``: one request's KV under one label."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheStream:
    """Pages, committed length and ``generation`` of stream ``(request_id, label)``.

    ``generation`` changes whenever what the pages hold may change under a reader's feet — a
    fork, a reset, a page-table move — so caches derived from the pages (the dense manager's
    gathered prefixes) key on it.
    """

    request_id: str
    label: str
    pages: list[int] = field(default_factory=list)
    length: int = 0  # committed tokens
    generation: int = 0  # unique across the manager: a re-created stream never repeats one
    # An admitted step is neither committed nor rolled back. A reset replaces the object, so the
    # mark goes with the stream it was set on.
    in_flight: bool = False
    # Its row in the manager's device page table (page_table.py); -1 until it first gets pages.
    table_row: int = -1
