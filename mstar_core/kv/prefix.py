"""The paged KV manager's prefix cache: a page pool whose full pages are published under a key,
shared between streams by reference count, kept when no stream holds them, and evicted least
recently used first only when the pool needs pages.

A page's key is ``(parent, tokens)``: the node id of the page before it (or of its root) and the
page's token ids. Keys are compared exactly (a dict of tuples, no digest), so two prefixes never
alias. A root is the stream's label with the resources' fingerprints and a model identity, so a
page is never found under another KV dtype, feature set, kernel or model.

A stream's keyed pages are always a chain from its root (pages are appended and cut from the
tail, and a stream that computed a page another published first takes that one), so whoever holds
a page holds its parent: an unheld page's descendants are unheld too, and since a stream's pages
go idle deepest first, a child is evicted before its parent.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mstar_core.errors import StateError
from mstar_core.kv.pool import PagePool

Key = tuple[int, tuple[int, ...]]  # (parent node id, the page's token ids)


@dataclass
class PrefixStats:
    """Counters since the cache was made."""

    lookups: int = 0  # streams started from the cache (admit_prefix)
    lookup_tokens: int = 0  # the tokens they brought
    hit_tokens: int = 0  # of those, found cached
    published: int = 0  # pages published
    evicted: int = 0  # cached pages evicted for the pool

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass
class PrefixChain:
    """One stream's place in the cache: its root, the token ids known for it (its prompt, and any
    given later), and how many of its leading pages are keyed (``keyed``: published, or found
    under a key another page holds; ``node``: the node id page ``keyed - 1`` is keyed under, the
    root's id while ``keyed`` is 0)."""

    root: int
    tokens: list[int]
    keyed: int
    node: int  # no defaults: node 0 is no root (ids count from 1), so its pages would never be found

    def copy(self, length: int) -> PrefixChain:
        """The chain of a fork of its stream at ``length`` committed tokens."""
        return PrefixChain(self.root, self.tokens[:length], self.keyed, self.node)


class _Entry(NamedTuple):
    page: int
    node: int
    key: Key


class PrefixCache(PagePool):
    """A :class:`PagePool` with published pages (see the module docstring). ``num_free`` counts
    idle cached pages too (they are handed out once the free ones run out); ``give_back`` of a
    page another stream still holds only drops a reference."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages)
        self.page_size = page_size
        self.stats = PrefixStats()
        self._ids = itertools.count(1)
        self._roots: dict[Hashable, int] = {}
        self._index: dict[Key, _Entry] = {}
        self._by_page: dict[int, _Entry] = {}
        # Holders of the pages that are published or shared (a private page is held once and is
        # not listed); a published page held by nobody is idle instead.
        self._refs: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.version = 0  # moves on whenever a key is added or removed: what a lookup finds may change

    # -- the pool ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def cached(self) -> int:
        """Published pages (held or idle)."""
        return len(self._by_page)

    @property
    def idle(self) -> int:
        """Published pages no stream holds: evicted for the pool when it runs out of free pages."""
        return len(self._idle)

    def take(self, n: int) -> list[int]:
        short = n - len(self._free)
        if 0 < short <= len(self._idle):
            for _ in range(short):
                self._evict(self._idle.popitem(last=False)[0])
        return super().take(n)

    def give_back(self, pages: list[int]) -> None:
        free = []
        for p in reversed(pages):  # the deepest page goes idle first: it is evicted first
            held = self._refs.get(p)
            if held is None:
                free.append(p)
            elif held > 1:
                self._refs[p] = held - 1
            else:
                del self._refs[p]
                if p in self._by_page:
                    self._idle[p] = None
                else:
                    free.append(p)
        if free:
            super().give_back(free[::-1])

    def share(self, pages: Sequence[int]) -> None:
        """One more stream holds ``pages`` (found in the cache, or a fork's full pages)."""
        for p in pages:
            if p in self._idle:
                del self._idle[p]
                self._refs[p] = 1
            else:
                self._refs[p] = self._refs.get(p, 1) + 1

    def _evict(self, page: int) -> None:
        e = self._by_page.pop(page)
        del self._index[e.key]
        self.version += 1
        self.stats.evicted += 1
        super().give_back([page])

    def clear(self) -> None:
        """Evict every idle page (the published pages streams hold stay published)."""
        while self._idle:
            self._evict(self._idle.popitem(last=False)[0])

    # -- keys ------------------------------------------------------------------------------------
    def root(self, key: Hashable) -> int:
        """The node id of root ``key`` (made on first use)."""
        got = self._roots.get(key)
        if got is None:
            got = self._roots[key] = next(self._ids)
        return got

    def _page_key(self, node: int, tokens: Sequence[int], i: int) -> Key:
        ps = self.page_size
        return node, tuple(tokens[i * ps: (i + 1) * ps])

    def lookup(self, root: int, tokens: Sequence[int], most: int) -> tuple[list[int], int]:
        """The cached pages that hold the first (at most ``most``) full pages of ``tokens`` under
        ``root``, and the node id the last of them is keyed under (``root`` if none)."""
        pages: list[int] = []
        node = root
        index = self._index
        # the pages' token tuples made by zip in C (a slice and a tuple per page cost twice as much)
        for _, page in zip(range(most), zip(*[iter(tokens)] * self.page_size, strict=False), strict=False):
            e = index.get((node, page))
            if e is None:
                break
            pages.append(e.page)
            node = e.node
        return pages, node

    def publish(self, chain: PrefixChain, pages: Sequence[int], upto: int) -> list[tuple[int, int]]:
        """Key the chain's pages ``chain.keyed .. upto - 1`` (full, committed, tokens known): each
        one is published, unless another page already holds its key (two streams computed it at
        once): then the stream takes that page instead and its own copy goes back, so whoever
        holds a page holds its parent. Returns those ``(index, page)`` for the caller to put in
        the stream's page list."""
        adopted: list[tuple[int, int]] = []
        for i in range(chain.keyed, upto):
            key = self._page_key(chain.node, chain.tokens, i)
            e = self._index.get(key)
            if e is None:
                page = pages[i]
                if page in self._by_page:
                    raise StateError(f"prefix cache: page {page} is published under another key")
                e = _Entry(page, next(self._ids), key)
                self._index[key] = e
                self.version += 1
                self._by_page[page] = e
                self._refs[page] = self._refs.get(page, 1)
                self.stats.published += 1
            elif e.page != pages[i]:
                self.share([e.page])
                self.give_back([pages[i]])
                adopted.append((i, e.page))
            chain.node = e.node
            chain.keyed = i + 1
        return adopted

    # -- accounting ------------------------------------------------------------------------------
    def check(self, owned: Sequence[int]) -> None:
        """What the streams hold (``owned``, a page once per holder) agrees with the references,
        and every page is free, held or idle, exactly one of them."""
        held = Counter(owned)
        bad = {p: (n, self._refs.get(p, 1)) for p, n in held.items() if n != self._refs.get(p, 1)}
        bad.update({p: (0, n) for p, n in self._refs.items() if p not in held})
        if bad:
            raise StateError(f"prefix cache: holders of pages (streams, references) disagree: "
                             f"{dict(itertools.islice(bad.items(), 8))}")
        idle = set(self._idle)
        if idle & set(held) or not idle <= set(self._by_page) or set(self._free) & (idle | set(held)):
            raise StateError("prefix cache: a page is at once free, held or idle")
        if set(held) | idle != set(self._used):
            raise StateError(f"prefix cache: {len(set(held) | idle)} pages held or idle, {len(self._used)} in use")
        if any(self._index.get(e.key) is not e for e in self._by_page.values()) or len(self._index) != self.cached:
            raise StateError("prefix cache: its index and its pages disagree")
