"""A free-page pool with ownership tracking."""

from __future__ import annotations

from mstar_core.errors import StateError


class PagePool:
    """Pages ``0 .. num_pages - 1``, handed out lowest id first from a fresh pool, then last
    returned first; the same sequence of calls always gives the same pages."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Popping from the end of a descending list gives the lowest id first.
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> frozenset[int]:
        return frozenset(self._used)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise StateError(f"PagePool: asked for {n} pages, {len(self._free)} free")
        got = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self._used.update(got)
        return got

    def give_back(self, pages: list[int]) -> None:
        back = set(pages)
        if not back <= self._used or len(back) != len(pages):
            bad = sorted(p for p in back if p not in self._used) or sorted(p for p in back if pages.count(p) > 1)
            raise StateError(f"PagePool: pages {bad[:8]} returned but not in use (double free)")
        self._used -= back
        # A stack: the pages just returned are the next handed out, in the same order, so
        # plans stay deterministic without sorting the free list on every release.
        self._free.extend(reversed(pages))
