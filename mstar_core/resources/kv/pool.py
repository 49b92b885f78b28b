"""A free-page pool with ownership tracking."""

from __future__ import annotations


class PagePool:
    """Pages ``0 .. num_pages - 1``; hands out the lowest free ids first (deterministic plans)."""

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
            raise RuntimeError(f"PagePool: asked for {n} pages, {len(self._free)} free")
        got = [self._free.pop() for _ in range(n)]
        self._used.update(got)
        return got

    def give_back(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"PagePool: page {p} returned but not in use (double free)")
            self._used.remove(p)
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)
