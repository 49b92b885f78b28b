"""GatheredPrefixCache on its own: keys, invalidation per stream, LRU order, accounting; entries
shared by several streams (gathered once, counted once, kept while a stream uses them)."""

import pytest
import torch

from mstar_core.attention.prefix_cache import GatheredPrefixCache


def kv(n):
    return torch.full((n, 1, 1), float(n)), torch.zeros(n, 1, 1)


def test_hit_miss_and_invalidation():
    c = GatheredPrefixCache()
    calls = []

    def gather(n):
        calls.append(n)
        return kv(n)

    a = ("a", "x")
    for layer in (0, 1, 0, 1):
        c.get(a, layer, (0, 4, (7,)), lambda: gather(4))
    assert calls == [4, 4] and (c.stats.hits, c.stats.gathers) == (2, 2) and c.tokens == 8
    c.validate(a, (1, 4, (7,)))  # generation moved: both layers go
    assert c.stats.invalidations == 2 and c.tokens == 0 and c.streams() == set()
    k, _ = c.get(a, 0, (1, 6, (7, 8)), lambda: gather(6))
    assert k.shape[0] == 6 and c.tokens == 6


def test_lru_evicts_least_recent_and_never_the_entry_in_use():
    c = GatheredPrefixCache(max_tokens=10)
    c.get(("a", "x"), 0, (0, 4, ()), lambda: kv(4))
    c.get(("b", "x"), 0, (0, 4, ()), lambda: kv(4))
    c.get(("a", "x"), 0, (0, 4, ()), lambda: kv(4))  # a is now the most recent
    c.get(("c", "x"), 0, (0, 4, ()), lambda: kv(4))  # over the bound: b goes
    assert c.streams() == {("a", "x"), ("c", "x")} and c.stats.evictions == 1 and c.tokens == 8
    c.get(("d", "x"), 0, (0, 20, ()), lambda: kv(20))  # alone over the bound: kept, others go
    assert c.streams() == {("d", "x")} and c.tokens == 20


def test_drop_request_and_clear():
    c = GatheredPrefixCache()
    for rid in ("a", "b"):
        for layer in range(3):
            c.get((rid, "x"), layer, (0, 2, ()), lambda: kv(2))
    c.drop_request("a")
    assert c.streams() == {("b", "x")} and c.stats.dropped == 3 and c.tokens == 6
    c.drop_request("zzz")
    c.clear()
    assert c.tokens == 0 and c.stats.dropped == 6
    with pytest.raises(ValueError, match="max_tokens"):
        GatheredPrefixCache(-1)


# -- shared entries ------------------------------------------------------------------------------

SH = (5, 4, (7,))  # (node, tokens, pages): one page of four tokens


def test_a_shared_entry_is_gathered_once_for_all_its_streams():
    c = GatheredPrefixCache()
    calls = []

    def gather(n):
        calls.append(n)
        return kv(n)

    for layer in (0, 1):
        for rid in "ab":
            c.get_shared((rid, "x"), layer, (0, 4, (7,)), SH, lambda: gather(4))
    assert calls == [4, 4] and (c.stats.gathers, c.stats.hits) == (2, 2)
    assert c.tokens == 8  # counted once, not once per stream
    assert c.streams() == {("a", "x"), ("b", "x")} and c.shared() == {SH: {("a", "x"), ("b", "x")}}
    # a stream whose prefix runs past the shared pages keeps the rest as its own entry
    got = c.get(("c", "x"), 0, (0, 6, (7, 8)), lambda: gather(2), SH)
    assert got[0].shape[0] == 2 and c.tokens == 10
    c.get_shared(("c", "x"), 0, (0, 6, (7, 8)), SH, lambda: gather(4))
    assert calls == [4, 4, 2] and c.stats.hits == 3


def test_dropping_a_request_keeps_a_shared_entry_its_other_streams_use():
    c = GatheredPrefixCache()
    for rid in "ab":
        for layer in (0, 1):
            c.get_shared((rid, "x"), layer, (0, 4, (7,)), SH, lambda: kv(4))
    c.drop_request("a")
    assert c.stats.dropped == 0 and c.tokens == 8 and c.shared() == {SH: {("b", "x")}}
    c.get_shared(("b", "x"), 0, (0, 4, (7,)), SH, lambda: kv(4))
    assert c.stats.gathers == 2  # b still hits
    c.drop_request("b")  # its last user: the entry goes
    assert c.stats.dropped == 2 and c.tokens == 0 and c.shared() == {} and c.streams() == set()


def test_a_stream_key_moving_off_a_shared_key_releases_it():
    c = GatheredPrefixCache()
    c.get(("a", "x"), 0, (0, 6, (7, 8)), lambda: kv(2), SH)
    c.get_shared(("a", "x"), 0, (0, 6, (7, 8)), SH, lambda: kv(4))
    c.get_shared(("b", "x"), 0, (0, 4, (7,)), SH, lambda: kv(4))
    # a's generation moves (a fork of it): its own rest goes, the shared entry stays
    c.validate(("a", "x"), (1, 6, (7, 8)), SH)
    assert c.stats.invalidations == 1 and c.tokens == 4 and c.shared() == {SH: {("a", "x"), ("b", "x")}}
    # a's prefix now has no shared pages: its own rest is rebuilt as its whole prefix
    c.validate(("a", "x"), (1, 6, (7, 8)))
    assert c.shared() == {SH: {("b", "x")}} and c.stats.invalidations == 1
    c.validate(("b", "x"), (0, 4, (9,)))  # b's pages moved: the shared key has no user left
    assert c.stats.invalidations == 2 and c.tokens == 0 and c.shared() == {}
    # the same shared key met again is gathered again
    c.get_shared(("b", "x"), 0, (0, 4, (7,)), SH, lambda: kv(4))
    assert c.stats.gathers == 3


def test_another_shared_key_drops_the_streams_own_rest():
    """The own entry holds the prefix after the shared pages: where those change (more pages
    keyed), it holds something else, so it is rebuilt even though the stream key is the same."""
    c = GatheredPrefixCache()
    key = (0, 8, (7, 8))
    c.get(("a", "x"), 0, key, lambda: kv(4), SH)
    c.validate(("a", "x"), key, (6, 8, (7, 8)))
    assert c.stats.invalidations == 1 and c.tokens == 0 and c.streams() == set()


def test_the_bound_counts_a_shared_entry_once_and_may_evict_it():
    c = GatheredPrefixCache(max_tokens=8)
    for rid in "abcd":  # four streams, one shared entry of four tokens: within the bound
        c.get_shared((rid, "x"), 0, (0, 4, (7,)), SH, lambda: kv(4))
    assert c.tokens == 4 and c.stats.evictions == 0
    c.get(("e", "x"), 0, (0, 4, (1,)), lambda: kv(4))
    c.get(("f", "x"), 0, (0, 4, (2,)), lambda: kv(4))  # over the bound: the least recent (shared) goes
    assert c.stats.evictions == 1 and c.tokens == 8 and c.shared() == {}
    c.get_shared(("a", "x"), 0, (0, 4, (7,)), SH, lambda: kv(4))  # rebuilt; e goes
    assert c.stats.gathers == 4 and c.streams() == {("a", "x"), ("b", "x"), ("c", "x"), ("d", "x"), ("f", "x")}
    c.clear()
    assert c.tokens == 0 and c.shared() == {} and c.stats.dropped == 2


def test_a_bound_of_zero_keeps_only_the_entry_in_use():
    c = GatheredPrefixCache(max_tokens=0)
    c.get(("a", "x"), 0, (0, 4, ()), lambda: kv(4))
    c.get(("b", "x"), 0, (0, 4, ()), lambda: kv(4))
    assert c.streams() == {("b", "x")} and c.stats.evictions == 1


def test_after_clear_the_streams_start_over_and_their_shared_keys_have_only_their_new_users():
    c = GatheredPrefixCache()
    for rid in "ab":
        c.get_shared((rid, "x"), 0, (0, 4, (7,)), SH, lambda: kv(4))
    c.clear()
    # nothing of a stream outlives clear(): no key, no shared key, no user of one
    assert (c._keys, c._shared_of, c._users, c._entries) == ({}, {}, {}, {})
    c.get_shared(("a", "x"), 0, (0, 4, (7,)), SH, lambda: kv(4))
    assert c.shared() == {SH: {("a", "x")}} and c.stats.gathers == 2
    c.drop_request("a")  # its last user gone: the shared entry goes with it
    assert c.shared() == {} and c.tokens == 0 and c.stats.dropped == 2
