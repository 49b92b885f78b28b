"""The prefix cache's page pool on its own (``PrefixCache``, no manager): take evicts only the
idle pages the free list lacks, oldest first; the version counts every key published or evicted;
publish refuses a page already published under another key; the hit rate of no lookups is 0; and
check() passes on a cache after many operations but names each of its invariants broken alone."""

from collections import Counter

import pytest
import torch

from mstar_core import KVConfig, KVManager, KVSpan, KVStep, Step, StepContext
from mstar_core.errors import StateError
from mstar_core.kv.pool import PagePool
from mstar_core.kv.prefix import PrefixCache, PrefixChain, PrefixStats

ROOT = b"model"


def chain(cache: PrefixCache, tokens: list[int]) -> PrefixChain:
    """A chain at its root: nothing keyed yet."""
    root = cache.root(ROOT)
    return PrefixChain(root, tokens, 0, root)


def test_the_hit_rate_of_no_lookups_is_zero():
    assert PrefixStats().hit_rate == 0.0
    assert PrefixStats(lookups=2, lookup_tokens=8, hit_tokens=2).hit_rate == 0.25
    assert PrefixCache(4, 2).stats.hit_rate == 0.0


def test_take_evicts_only_the_idle_pages_the_free_list_lacks_oldest_first():
    cache = PrefixCache(4, 2)
    pages = cache.take(2)
    cache.publish(chain(cache, [1, 2, 3, 4]), pages, 2)
    cache.give_back(pages)  # the deepest goes idle first
    assert list(cache._idle) == [pages[1], pages[0]] and cache.num_free == 4
    assert cache.take(1) == [2] and cache.take(1) == [3]  # the free list has them: nothing evicted
    assert (cache.idle, cache.cached, cache.stats.evicted) == (2, 2, 0)
    with pytest.raises(StateError, match="asked for 3 pages, 0 free"):
        cache.take(3)  # more than the idle pages can make up: none evicted
    assert (cache.idle, cache.cached, cache.stats.evicted) == (2, 2, 0)
    assert cache.take(0) == [] and cache.idle == 2
    assert cache.take(1) == [pages[1]] and cache.stats.evicted == 1  # the oldest idle one
    assert cache.lookup(cache.root(ROOT), [1, 2, 3, 4], 2)[0] == [pages[0]]
    assert cache.take(1) == [pages[0]] and (cache.idle, cache.cached, cache.stats.evicted) == (0, 0, 2)


def test_the_version_counts_every_key_published_or_evicted():
    cache = PrefixCache(6, 2)
    s = cache.stats
    assert cache.version == 0
    a, pa = chain(cache, [1, 2, 3, 4, 5]), cache.take(3)
    assert cache.publish(a, pa, 2) == [] and (s.published, cache.version) == (2, 2)
    assert cache.lookup(a.root, [1, 2, 3, 4], 2) == (pa[:2], a.node)
    b, pb = chain(cache, [1, 2, 3, 4, 9]), cache.take(2)
    # b computed the same pages: it takes a's, no key is added
    assert cache.publish(b, pb, 2) == [(0, pa[0]), (1, pa[1])] and (s.published, cache.version) == (2, 2)
    cache.give_back(pa[:2])  # b's
    cache.give_back(pa)  # a's: its two published pages go idle
    assert cache.idle == 2
    cache.take(cache.num_free)  # every free page, then both idle ones
    assert (s.published, s.evicted, cache.version) == (2, 2, 4)


def test_publish_refuses_a_page_published_under_another_key():
    cache = PrefixCache(4, 2)
    pages = cache.take(2)
    cache.publish(chain(cache, [1, 2, 3, 4]), pages, 2)
    version = cache.version
    other = chain(cache, [7, 8])
    with pytest.raises(StateError, match=rf"page {pages[1]} is published under another key"):
        cache.publish(other, pages[1:], 1)
    assert (cache.cached, cache.version, other.keyed) == (2, version, 0)
    assert cache.lookup(other.root, [7, 8], 1)[0] == [] and cache.lookup(other.root, [1, 2, 3, 4], 2)[0] == pages


# -- check() ----------------------------------------------------------------------------------------


def step(kv: KVManager, rid: str, n: int) -> None:
    st, ctx = Step(KVStep((KVSpan(rid, "t", n),))), StepContext()
    assert kv.admit(st, ctx)
    kv.plan(st, ctx)
    kv.commit(st, ctx)


def busy_kv() -> KVManager:
    """A manager after streams came and went (prompts sharing 0 to 3 pages, forks, evictions): its
    pool holds pages shared, published and held once, private, idle and free (page size 2)."""
    kv = KVManager(KVConfig(1, 1, 4, 2, 12, 1), "cpu", torch.float32, prefix_cache=True)
    for i in range(10):
        rid = f"r{i}"
        kv.ingest_request(rid)
        prompt = [1, 2, 3, 4, 5, 6][: 2 * (i % 4)] + [10 + i, 20 + i, 30 + i]
        step(kv, rid, len(prompt) - kv.admit_prefix(rid, "t", prompt, ROOT).cached_tokens)
        if i % 3 == 1:
            kv.ingest_request(f"f{i}")
            assert kv.fork(rid, f"f{i}", "t")
        for old in (f"r{i - 2}", f"f{i - 2}"):
            if old in kv.requests:
                kv.remove_request(old)
        kv.post_warmup_validate()
    kv.ingest_request("f")
    assert kv.fork("r9", "f", "t")
    return kv


def kinds(kv: KVManager) -> dict[str, int]:
    """A page of each kind in ``kv``'s pool."""
    pool = kv.pool
    assert isinstance(pool, PrefixCache)
    held = Counter(p for s in kv.streams.values() for p in s.pages)
    return {
        "shared": next(p for p, n in held.items() if n > 1),
        "published": next(p for p, n in held.items() if n == 1 and p in pool._by_page),
        "private": next(p for p in held if p not in pool._by_page),
        "idle": next(iter(pool._idle)),
        "free": pool._free[-1],
    }


def test_check_passes_on_a_cache_after_many_operations():
    kv = busy_kv()
    pool = kv.pool
    assert isinstance(pool, PrefixCache)
    assert pool.stats.evicted > 0 and pool.stats.hit_tokens > 0 and len(kinds(kv)) == 5
    pool.check([p for s in kv.streams.values() for p in s.pages])
    kv.post_warmup_validate()


def _unpublish(pool: PrefixCache, p: int) -> None:
    del pool._index[pool._by_page.pop(p).key]


def _evict_leaving_the_key(pool: PrefixCache, p: int) -> None:
    del pool._idle[p], pool._by_page[p]
    PagePool.give_back(pool, [p])


def _index_another_entry(pool: PrefixCache, p: int) -> None:
    other = next(e for q, e in pool._by_page.items() if q != p)
    pool._index[pool._by_page[p].key] = other


HOLDERS = r"holders of pages \(streams, references\) disagree: \{{{page}: \(%s\)\}}"
AT_ONCE = "a page is at once free, held or idle"
USED = "{n} pages held or idle, {less} in use"
INDEX = "its index and its pages disagree"

# (what is broken, on a page of which kind, how, check()'s message: {page}; {n} held or idle before)
BROKEN = [
    ("a shared page's count one short", "shared", lambda pool, p: pool._refs.__setitem__(p, 1), HOLDERS % "2, 1"),
    ("a count for a page no stream holds", "free", lambda pool, p: pool._refs.__setitem__(p, 1), HOLDERS % "0, 1"),
    ("a held page also idle", "published", lambda pool, p: pool._idle.__setitem__(p, None), AT_ONCE),
    ("an idle page not published", "idle", _unpublish, AT_ONCE),
    ("an idle page also free", "idle", lambda pool, p: pool._free.append(p), AT_ONCE),
    ("a held page also free", "private", lambda pool, p: pool._free.append(p), AT_ONCE),
    ("a held page not in use", "private", lambda pool, p: pool._used.discard(p), USED),
    ("a key indexing another page's entry", "idle", _index_another_entry, INDEX),
    ("an evicted page's key left in the index", "idle", _evict_leaving_the_key, INDEX),
]


@pytest.mark.parametrize("kind, corrupt, message", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_check_names_each_broken_invariant(kind, corrupt, message):
    kv = busy_kv()
    pool = kv.pool
    page = kinds(kv)[kind]
    n = len({p for s in kv.streams.values() for p in s.pages} | set(pool._idle))
    corrupt(pool, page)
    with pytest.raises(StateError, match="prefix cache: " + message.format(page=page, n=n, less=n - 1)):
        kv.post_warmup_validate()
