"""``CacheStream``: one request's KV under one label."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar_core.kv.prefix import PrefixChain


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
    # Its place in the prefix cache (None: the cache is off, or the stream never gave its tokens).
    chain: PrefixChain | None = None


class StreamMap(dict[tuple[str, str], CacheStream]):
    """The manager's streams by ``(request_id, label)``, with ``version`` counting every change of
    which object a key maps to (an entry set, removed or cleared): a step admitted at version v
    whose plan or commit finds v still there knows its streams are the current ones without
    looking each one up again. Reads are the plain dict's."""

    version = 0

    def __setitem__(self, key: tuple[str, str], value: CacheStream) -> None:
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: tuple[str, str]) -> None:
        self.version += 1
        super().__delitem__(key)

    def clear(self) -> None:
        self.version += 1
        super().clear()

    def pop(self, *args: Any) -> Any:
        self.version += 1
        return super().pop(*args)

    def popitem(self) -> tuple[tuple[str, str], CacheStream]:
        self.version += 1
        return super().popitem()

    def setdefault(self, key: tuple[str, str], default: Any = None) -> Any:
        self.version += 1
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.version += 1
        super().update(*args, **kwargs)

    def __ior__(self, other: Any) -> StreamMap:  # type: ignore[override,misc]
        self.update(other)
        return self
