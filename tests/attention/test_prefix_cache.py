"""GatheredPrefixCache on its own: keys, invalidation per stream, LRU order, accounting."""

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
