"""The paged KV manager's prefix cache (``KVManager(..., prefix_cache=True)``): hits share pages,
the last prompt token is always computed, a root (fingerprints, model identity, label) never
matches another, idle pages are evicted least recently used first and only when the pool needs
them, a held page never, an admit never hands out pages evicted since its match, fork shares full
pages, extend_tokens publishes generated tokens' pages, clear_prefix_cache evicts only idle pages,
bad input is refused, parked streams give their shared references back when their step lands, and
tensor-parallel checks cover the cached pages."""

import pytest
import torch

from mstar_core import AttentionFeatures, KVConfig, KVManager, KVSpan, KVStep, Node, Step, StepContext
from mstar_core.errors import InputError, InputTypeError, StateError, UnknownName
from mstar_core.kv.prefix import PrefixCache

ROOT = b"model"
HKV, D = 1, 4


def make_kv(max_pages=8, ps=4, layers=2, prefix_cache=True, **kw) -> KVManager:
    return KVManager(KVConfig(layers, HKV, D, ps, max_pages, HKV), "cpu", torch.float32,
                     prefix_cache=prefix_cache, **kw)


def values(tokens, positions, layer):
    """What a step writes for ``tokens`` at ``positions`` in ``layer`` (K; V is its negative)."""
    t = torch.tensor(tokens, dtype=torch.float32)
    p = torch.tensor(positions, dtype=torch.float32)
    return (t * 64 + p + layer * 0.5)[:, None, None].expand(-1, HKV, D).contiguous()


def begin(kv, spans, tokens):
    """Admit and plan a step over ``spans`` (rid, n[, commit]) and write each span's ``tokens[rid]``
    (the step's new ones); returns (step, ctx, plan), or None when refused."""
    st = Step(KVStep(tuple(KVSpan(s[0], "t", *s[1:]) for s in spans)))
    ctx = StepContext()
    if not kv.admit(st, ctx):
        return None
    plan = kv.plan(st, ctx)
    lay = plan.layout("t")
    toks = [t for s in spans for t in tokens[s[0]]]
    for layer in range(kv.config.num_layers):
        k = values(toks, lay.positions.tolist(), layer)
        kv.write_kv(k, -k, layer, "t")
    return st, ctx, plan


def run(kv, spans, tokens):
    got = begin(kv, spans, tokens)
    assert got is not None, "refused"
    st, ctx, plan = got
    kv.commit(st, ctx)
    return plan


def start(kv, rid, prompt, root=ROOT, label="t"):
    """ingest, admit_prefix and prefill ``prompt``; returns the tokens found cached."""
    kv.ingest_request(rid)
    out = kv.admit_prefix(rid, label, prompt, root)
    assert out
    n = out.cached_tokens
    if label == "t":
        run(kv, [(rid, len(prompt) - n)], {rid: prompt[n:]})
    return n


def held(kv, rid):
    return list(kv.stream(rid, "t").pages)


def contents(kv, rid):
    """The K of ``rid``'s committed tokens, read through its pages ([layers, tokens, H, D])."""
    s = kv.stream(rid, "t")
    pos = torch.arange(s.length)
    ps = kv.config.page_size
    return kv.storage[:, torch.tensor(s.pages)[pos // ps], 0, pos % ps]


def expected(kv, tokens):
    return torch.stack([values(tokens, list(range(len(tokens))), i) for i in range(kv.config.num_layers)])


# -- hits -----------------------------------------------------------------------------------------


def test_a_hit_shares_the_pages_and_the_plan_reads_them():
    kv = make_kv()
    a = list(range(1, 10))  # 2 full pages and 1 token
    assert start(kv, "a", a) == 0
    assert kv.pool.cached == 2 and kv.prefix_stats.published == 2
    b = a[:8] + [50, 51, 52]
    kv.ingest_request("b")
    assert kv.match_prefix(b, ROOT, "t") == 8
    out = kv.admit_prefix("b", "t", b, ROOT)
    assert out.cached_tokens == 8 and kv.stream("b", "t").length == 8
    shared = held(kv, "a")[:2]
    assert held(kv, "b") == shared
    assert all(kv.pool._refs[p] == 2 for p in shared)
    plan = run(kv, [("b", 3)], {"b": b[8:]})
    sl = plan.layout("t").spans[0]
    assert (sl.length, sl.to_compute, sl.prefix_len) == (11, 3, 8)
    assert plan.layout("t").kv_indices.tolist()[:2] == shared  # attention reads the cached pages
    assert torch.equal(contents(kv, "b"), expected(kv, b))
    s = kv.prefix_stats
    assert (s.lookups, s.lookup_tokens, s.hit_tokens) == (2, 9 + 11, 8)
    assert s.hit_rate == 8 / 20
    kv.post_warmup_validate()


def test_match_prefix_changes_nothing():
    kv = make_kv()
    start(kv, "a", list(range(1, 10)))
    before = (kv.prefix_stats.lookups, kv.prefix_stats.hit_tokens, dict(kv.pool._refs), list(kv.pool._idle))
    assert kv.match_prefix(list(range(1, 12)), ROOT, "t") == 8
    assert (kv.prefix_stats.lookups, kv.prefix_stats.hit_tokens, dict(kv.pool._refs), list(kv.pool._idle)) == before


@pytest.mark.parametrize("n, want", [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8)])
def test_the_last_token_is_always_computed(n, want):
    """A prompt finds at most ``(len - 1) // page_size`` pages: a fully cached page-aligned prompt
    still computes its last page."""
    kv = make_kv()
    start(kv, "a", list(range(1, 13)))  # 3 full pages published
    assert kv.pool.cached == 3
    kv.ingest_request("b")
    assert kv.match_prefix(list(range(1, n + 1)), ROOT, "t") == want
    out = kv.admit_prefix("b", "t", list(range(1, n + 1)), ROOT)
    assert out.cached_tokens == want and len(held(kv, "b")) == want // 4


def test_a_prompt_diverging_inside_a_page_finds_only_the_pages_before():
    kv = make_kv()
    start(kv, "a", list(range(1, 13)))
    kv.ingest_request("b")
    assert kv.match_prefix([1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12, 13], ROOT, "t") == 4
    # the same page of tokens deeper in the prompt is a different key (its parent differs)
    assert kv.match_prefix([5, 6, 7, 8, 1, 2, 3, 4, 9], ROOT, "t") == 0


def test_two_streams_computing_the_same_prefix_publish_it_once():
    """Two requests start from the cache before either has committed: both compute the prompt,
    the first to commit publishes it, and the second takes those pages in place of its copies
    (which go back to the pool), so its own next page is published below pages it holds."""
    kv = make_kv(max_pages=12, ps=4)
    for r in "ab":
        kv.ingest_request(r)
    a, b = list(range(1, 10)), list(range(1, 9)) + [60, 61, 62, 63, 64]
    assert kv.admit_prefix("a", "t", a, ROOT).cached_tokens == 0
    assert kv.admit_prefix("b", "t", b, ROOT).cached_tokens == 0
    got = begin(kv, [("a", 9), ("b", 13)], {"a": a, "b": b})
    assert got is not None
    copies = held(kv, "b")[:2]
    free = kv.pool.num_free
    kv.commit(got[0], got[1])
    pa, pb = held(kv, "a"), held(kv, "b")
    assert pb[:2] == pa[:2] and pb[2] not in pa
    assert kv.pool.num_free == free + 2 and not set(copies) & set(pa + pb)  # b's copies went back
    assert kv.prefix_stats.published == 3 and set(kv.pool._by_page) == {pa[0], pa[1], pb[2]}
    assert kv.pool._refs[pa[0]] == 2
    assert torch.equal(contents(kv, "b"), expected(kv, b))
    kv.ingest_request("c")
    assert start(kv, "c", b[:12] + [70]) == 12
    assert held(kv, "c")[:3] == [pa[0], pa[1], pb[2]]
    assert torch.equal(contents(kv, "c"), expected(kv, b[:12] + [70]))
    kv.post_warmup_validate()


def test_a_page_published_below_a_page_computed_twice_stays_reachable():
    """The second stream to commit a page another published takes that page: once the first
    stream is gone and its other pages are evicted, the second's prefix is still found whole."""
    kv = make_kv(max_pages=6, ps=2, layers=1)
    for r in "zw":
        kv.ingest_request(r)
    kv.admit_prefix("z", "t", [1, 2, 3, 4, 5], ROOT)
    kv.admit_prefix("w", "t", [1, 2, 9], ROOT)
    run(kv, [("w", 3)], {"w": [1, 2, 9]})
    run(kv, [("z", 5)], {"z": [1, 2, 3, 4, 5]})  # z's [1, 2] was computed again: it takes w's
    kv.remove_request("w")
    kv.ingest_request("x")
    run(kv, [("x", 6)], {"x": [7] * 6})  # takes every free and idle page the pool can spare
    assert kv.match_prefix([1, 2, 3, 4, 5], ROOT, "t") == 4  # z still holds [1, 2] and [3, 4]
    kv.remove_request("x")
    kv.remove_request("z")
    assert kv.match_prefix([1, 2, 3, 4, 5], ROOT, "t") == 4
    kv.post_warmup_validate()


# -- roots ----------------------------------------------------------------------------------------


def fp8_kv(**kw):
    feats = AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0)
    return make_kv(features=feats, **kw)


def test_an_fp8_cache_has_another_fingerprint_and_root():
    plain, fp8 = make_kv(), fp8_kv()
    assert fp8.kv_dtype == torch.float8_e4m3fn
    assert plain.fingerprint() != fp8.fingerprint()
    root_plain, root_fp8 = Node([plain]).prefix_root("m"), Node([fp8]).prefix_root("m")
    assert root_plain != root_fp8
    assert plain.fingerprint() in root_plain and fp8.fingerprint() in root_fp8
    # other scales are another root too
    other = make_kv(features=AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=0.25, v_scale=2.0))
    assert Node([other]).prefix_root("m") != root_fp8
    # pages published under one root are not found under the other
    prompt = list(range(1, 10))
    start(plain, "a", prompt, root_plain)
    plain.ingest_request("b")
    assert plain.match_prefix(prompt, root_plain, "t") == 8
    assert plain.match_prefix(prompt, root_fp8, "t") == 0
    assert plain.admit_prefix("b", "t", prompt, root_fp8).cached_tokens == 0 and held(plain, "b") == []


def test_an_fp8_cache_hits_under_its_own_root_and_reads_back_what_it_stored():
    kv = fp8_kv()
    root = Node([kv]).prefix_root("m")
    prompt = list(range(1, 10))
    start(kv, "a", prompt, root)
    assert start(kv, "b", prompt, root) == 8
    assert held(kv, "b")[:2] == held(kv, "a")[:2]
    a, b = kv.stream("a", "t"), kv.stream("b", "t")
    assert torch.equal(kv.storage[:, a.pages[2]].float(), kv.storage[:, b.pages[2]].float())


def test_another_model_identity_label_or_root_misses():
    kv = make_kv(max_pages=16)
    node = Node([kv])
    root_a, root_b = node.prefix_root("weights-a"), node.prefix_root(b"weights-b")
    assert root_a != root_b and node.prefix_root("weights-a") == root_a
    prompt = list(range(1, 10))
    start(kv, "a", prompt, root_a)
    kv.ingest_request("b")
    assert kv.match_prefix(prompt, root_a, "t") == 8
    assert kv.match_prefix(prompt, root_b, "t") == 0
    assert kv.match_prefix(prompt, root_a, "u") == 0
    assert kv.match_prefix(prompt, b"", "t") == 0
    assert kv.admit_prefix("b", "t", prompt, root_b).cached_tokens == 0
    assert kv.admit_prefix("b", "u", prompt, root_a).cached_tokens == 0
    assert kv.prefix_stats.hit_tokens == 0
    with pytest.raises(InputError, match="non-empty str or bytes"):
        node.prefix_root("")


# -- eviction -------------------------------------------------------------------------------------


def test_idle_pages_count_as_free_and_are_evicted_oldest_first_deepest_first():
    kv = make_kv(max_pages=8, ps=2)
    start(kv, "a", [1, 2, 3, 4, 5])  # pages a0 a1 published, a2 partial
    start(kv, "c", [7, 8, 9])  # page c0 published, c1 partial
    a, c = held(kv, "a"), held(kv, "c")
    kv.remove_request("a")  # a1 then a0 go idle; a2 is free
    kv.remove_request("c")
    pool = kv.pool
    assert list(pool._idle) == [a[1], a[0], c[0]]
    assert kv.num_free_pages == 8 and pool.cached == 3
    # as many pages as are free: nothing evicted
    kv.ingest_request("x")
    run(kv, [("x", 10)], {"x": list(range(30, 40))})  # 5 pages: the free ones
    assert pool.stats.evicted == 0 and pool.cached == 3
    # one more page: the oldest idle one (a's deepest), then the next
    run(kv, [("x", 2)], {"x": [40, 41]})
    assert pool.stats.evicted == 1 and a[1] in held(kv, "x")
    assert list(pool._idle) == [a[0], c[0]] and a[1] not in pool._by_page
    kv.ingest_request("y")
    assert kv.match_prefix([1, 2, 3, 4, 5], ROOT, "t") == 2  # a0 is still cached
    run(kv, [("y", 2)], {"y": [42, 43]})
    assert list(pool._idle) == [c[0]] and a[0] in held(kv, "y")
    assert kv.match_prefix([1, 2, 3, 4, 5], ROOT, "t") == 0 and kv.match_prefix([7, 8, 9], ROOT, "t") == 2
    kv.post_warmup_validate()


def test_a_hit_takes_a_page_off_the_idle_list_and_releasing_it_makes_it_the_newest():
    kv = make_kv(max_pages=8, ps=2)
    start(kv, "a", [1, 2, 3])
    start(kv, "c", [7, 8, 9])
    a0, c0 = held(kv, "a")[0], held(kv, "c")[0]
    kv.remove_request("a")
    kv.remove_request("c")
    assert list(kv.pool._idle) == [a0, c0]
    assert start(kv, "b", [1, 2, 5]) == 2  # a0 is held again
    assert list(kv.pool._idle) == [c0] and kv.pool._refs[a0] == 1
    kv.remove_request("b")
    assert list(kv.pool._idle) == [c0, a0]  # now c0 is the oldest


def test_a_held_page_is_never_evicted_the_step_is_refused_instead():
    kv = make_kv(max_pages=4, ps=2)
    start(kv, "a", [1, 2, 3, 4, 5, 6])  # 3 pages, all published, held
    assert start(kv, "b", [1, 2, 3, 4, 9]) == 4  # shares 2 of them
    kv.remove_request("a")  # a's pages are still held by b (a2: idle)
    pool = kv.pool
    b = held(kv, "b")
    assert kv.num_free_pages == 1 and len(pool._idle) == 1
    kv.ingest_request("x")
    before = (list(pool._free), list(pool._idle), dict(pool._refs), pool.stats.evicted)
    out = kv.admit(Step(KVStep((KVSpan("x", "t", 3),))), StepContext())  # 2 pages: 1 free or idle
    assert not out and "needs 2 pages" in out.reason()
    assert (list(pool._free), list(pool._idle), dict(pool._refs), pool.stats.evicted) == before
    assert held(kv, "b") == b and all(p in pool._by_page for p in b[:2])
    assert torch.equal(contents(kv, "b"), expected(kv, [1, 2, 3, 4, 9]))
    run(kv, [("x", 2)], {"x": [20, 21]})  # the idle one is evicted, b's are not
    assert pool.stats.evicted == 1 and held(kv, "b") == b
    kv.post_warmup_validate()


def test_an_eviction_moves_the_version_and_an_admit_matched_before_it_walks_again():
    """admit_prefix reuses match_prefix's walk only while no key changed: pages evicted in between
    (taken by another stream) must not be handed out."""
    kv = make_kv(max_pages=4, ps=2)
    start(kv, "a", [1, 2, 3, 4, 5])  # a0 a1 published, a2 partial
    kv.remove_request("a")  # a0 a1 idle, 2 pages free
    p = [1, 2, 3, 4, 9]
    assert kv.match_prefix(p, ROOT, "t") == 4
    pool = kv.pool
    version = pool.version
    kv.ingest_request("x")
    run(kv, [("x", 6)], {"x": [30, 31, 32, 33, 34, 35]})  # the 2 free pages, then the oldest idle one
    assert pool.stats.evicted == 1 and pool.version == version + 1
    run(kv, [("x", 2)], {"x": [36, 37]})  # the last idle one
    assert pool.stats.evicted == 2 and pool.version == version + 2
    kv.ingest_request("b")
    assert kv.admit_prefix("b", "t", p, ROOT).cached_tokens == 0
    assert held(kv, "b") == [] and kv.stream("b", "t").chain.keyed == 0
    kv.post_warmup_validate()


def test_a_publish_moves_the_version_and_an_admit_matched_before_it_finds_the_new_pages():
    """A page published between match_prefix and admit_prefix is found by the admit: the match's
    walk is stale once a key is added, as it is once one is removed."""
    kv = make_kv(max_pages=12, ps=4)
    start(kv, "a", [1, 2, 3, 4, 5])  # publishes [1..4]
    p = list(range(1, 10))
    assert kv.match_prefix(p, ROOT, "t") == 4
    version = kv.pool.version
    start(kv, "q", list(range(1, 9)) + [50])  # publishes [5..8] below it
    assert kv.pool.version == version + 1
    kv.ingest_request("b")
    assert kv.admit_prefix("b", "t", p, ROOT).cached_tokens == 8
    assert held(kv, "b") == held(kv, "q")[:2]
    kv.post_warmup_validate()


def test_an_admit_matched_before_a_clear_finds_nothing():
    kv = make_kv(max_pages=8, ps=2)
    start(kv, "a", [1, 2, 3, 4, 5])
    kv.remove_request("a")
    p = [1, 2, 3, 4, 9]
    assert kv.match_prefix(p, ROOT, "t") == 4
    version = kv.pool.version
    assert kv.clear_prefix_cache() == 2
    assert kv.pool.version == version + 2
    kv.ingest_request("b")
    assert kv.admit_prefix("b", "t", p, ROOT).cached_tokens == 0 and held(kv, "b") == []
    kv.post_warmup_validate()


# -- fork, extend_tokens, clear ---------------------------------------------------------------------


def test_fork_shares_full_pages_and_copies_only_the_partial_one():
    kv = make_kv(max_pages=8, ps=4)
    start(kv, "a", [1, 2, 3, 4, 5, 6])  # page 0 full, page 1 holds 2 tokens
    kv.ingest_request("b")
    free = kv.num_free_pages
    assert kv.fork("a", "b", "t")
    a, b = held(kv, "a"), held(kv, "b")
    assert b[0] == a[0] and b[1] != a[1] and kv.num_free_pages == free - 1
    assert kv.pool._refs[a[0]] == 2
    assert torch.equal(kv.storage[:, b[1]], kv.storage[:, a[1]])
    assert torch.equal(contents(kv, "b"), expected(kv, [1, 2, 3, 4, 5, 6]))
    # each writes its own partial page from here
    run(kv, [("a", 1), ("b", 1)], {"a": [70], "b": [80]})
    assert torch.equal(contents(kv, "a"), expected(kv, [1, 2, 3, 4, 5, 6, 70]))
    assert torch.equal(contents(kv, "b"), expected(kv, [1, 2, 3, 4, 5, 6, 80]))
    kv.remove_request("a")
    assert kv.pool._refs[a[0]] == 1 and a[0] not in kv.pool._idle  # b still holds it
    kv.post_warmup_validate()
    kv.remove_request("b")
    assert a[0] in kv.pool._idle and kv.num_free_pages == 8


def test_fork_of_a_plain_stream_shares_unpublished_pages_that_go_free_with_the_last_holder():
    kv = make_kv(max_pages=8, ps=4)
    for r in "ab":
        kv.ingest_request(r)
    run(kv, [("a", 9)], {"a": list(range(1, 10))})  # no admit_prefix: nothing published
    assert kv.fork("a", "b", "t")
    shared = held(kv, "a")[:2]
    assert held(kv, "b")[:2] == shared and kv.pool.cached == 0
    kv.remove_request("a")
    assert not set(shared) & set(kv.pool._free)
    kv.remove_request("b")
    assert set(shared) <= set(kv.pool._free) and kv.pool.idle == 0 and kv.num_free_pages == 8


def test_extend_tokens_publishes_the_generated_tokens_committed_pages():
    kv = make_kv(max_pages=12, ps=4)
    prompt, gen = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    start(kv, "a", prompt)
    for t in gen:  # decode: the chain does not know these tokens
        run(kv, [("a", 1)], {"a": [t]})
    assert kv.pool.cached == 1
    kv.ingest_request("b")
    assert kv.match_prefix(prompt + gen + [11], ROOT, "t") == 4
    kv.extend_tokens("a", "t", gen)  # 10 tokens known and committed: page 1 is published now
    assert kv.pool.cached == 2 and kv.stream("a", "t").chain.keyed == 2
    assert kv.match_prefix(prompt + gen + [11], ROOT, "t") == 8
    # tokens given ahead of their step are published when it commits
    kv.extend_tokens("a", "t", [11, 12])
    assert kv.pool.cached == 2
    run(kv, [("a", 2)], {"a": [11, 12]})
    assert kv.pool.cached == 3
    assert start(kv, "b", prompt + gen + [11, 12, 13]) == 12
    assert held(kv, "b")[:3] == held(kv, "a")
    assert torch.equal(contents(kv, "b"), expected(kv, prompt + gen + [11, 12, 13]))


def test_clear_prefix_cache_evicts_only_idle_pages():
    kv = make_kv(max_pages=12, ps=2)
    start(kv, "a", [1, 2, 3, 4, 5])  # 2 published, held
    start(kv, "c", [7, 8, 9, 10, 11])  # 2 published
    kv.remove_request("c")  # idle
    assert (kv.pool.cached, kv.pool.idle) == (4, 2)
    assert kv.clear_prefix_cache() == 2
    assert (kv.pool.cached, kv.pool.idle, kv.prefix_stats.evicted) == (2, 0, 2)
    assert kv.num_free_pages == 12 - 3
    kv.ingest_request("b")
    assert kv.match_prefix([1, 2, 3, 4, 5], ROOT, "t") == 4 and kv.match_prefix([7, 8, 9, 10, 11], ROOT, "t") == 0
    assert kv.clear_prefix_cache() == 0
    kv.post_warmup_validate()


def test_a_rolled_back_step_publishes_nothing():
    kv = make_kv()
    kv.ingest_request("a")
    assert kv.admit_prefix("a", "t", list(range(1, 10)), ROOT).cached_tokens == 0
    st, ctx, _ = begin(kv, [("a", 9)], {"a": list(range(1, 10))})
    kv.rollback_admit(st, ctx)
    assert kv.pool.cached == 0 and kv.prefix_stats.published == 0
    assert kv.stream("a", "t").length == 0 and kv.num_free_pages == 8
    kv.ingest_request("b")
    assert kv.match_prefix(list(range(1, 10)), ROOT, "t") == 0
    run(kv, [("a", 9)], {"a": list(range(1, 10))})  # the retry publishes
    assert kv.pool.cached == 2


def test_commit_false_tokens_are_never_published():
    kv = make_kv()
    kv.ingest_request("a")
    kv.admit_prefix("a", "t", list(range(1, 10)), ROOT)
    run(kv, [("a", 9, False)], {"a": list(range(1, 10))})
    assert kv.pool.cached == 0 and kv.stream("a", "t").length == 0 and kv.num_free_pages == 8


# -- errors -----------------------------------------------------------------------------------------


def test_the_cache_off_refuses_its_methods_naming_the_flag():
    kv = make_kv(prefix_cache=False)
    kv.ingest_request("a")
    assert not isinstance(kv.pool, PrefixCache)
    for call in (lambda: kv.admit_prefix("a", "t", [1, 2]), lambda: kv.match_prefix([1, 2], ROOT, "t"),
                 lambda: kv.extend_tokens("a", "t", [1]), kv.clear_prefix_cache, lambda: kv.prefix_stats):
        with pytest.raises(StateError, match=r"prefix_cache=True"):
            call()
    assert ("a", "t") not in kv.streams


def test_prefix_cache_must_be_a_bool():
    with pytest.raises(InputTypeError, match="prefix_cache must be a bool"):
        make_kv(prefix_cache="yes")
    with pytest.raises(InputTypeError, match="prefix_cache must be a bool"):
        make_kv(prefix_cache=1)


def test_admit_prefix_refuses_a_stream_that_already_has_tokens():
    kv = make_kv()
    start(kv, "a", [1, 2, 3, 4, 5])
    lookups = kv.prefix_stats.lookups
    with pytest.raises(StateError, match="already holds 5 tokens"):
        kv.admit_prefix("a", "t", [1, 2, 3, 4, 5, 6], ROOT)
    kv.ingest_request("p")
    run(kv, [("p", 2)], {"p": [1, 2]})  # a plain stream with tokens
    with pytest.raises(StateError, match="starts from the cache once"):
        kv.admit_prefix("p", "t", [1, 2, 3], ROOT)
    kv.ingest_request("q")
    kv.admit_prefix("q", "t", [1, 2, 3], ROOT)  # started, no tokens yet: still refused
    with pytest.raises(StateError, match="starts from the cache once"):
        kv.admit_prefix("q", "t", [1, 2, 3], ROOT)
    assert kv.prefix_stats.lookups == lookups + 1
    kv.reset_request("a")  # after a reset the stream may start again
    assert kv.admit_prefix("a", "t", [1, 2, 3, 4, 5, 6], ROOT).cached_tokens == 4


def test_admit_prefix_refuses_bad_token_ids_and_unknown_requests():
    kv = make_kv()
    kv.ingest_request("a")
    with pytest.raises(InputError, match="token_ids is empty"):
        kv.admit_prefix("a", "t", [], ROOT)
    with pytest.raises(InputTypeError, match=r"token_ids must be ints, got 2\.0"):
        kv.admit_prefix("a", "t", [1, 2.0], ROOT)
    with pytest.raises(InputTypeError, match="token_ids must be ints"):
        kv.admit_prefix("a", "t", [1, None], ROOT)
    with pytest.raises(InputTypeError, match="sequence of ints, got str"):
        kv.admit_prefix("a", "t", "abc", ROOT)
    with pytest.raises(InputTypeError, match="root must be bytes"):
        kv.admit_prefix("a", "t", [1, 2], "model")
    with pytest.raises(UnknownName, match=r"'ghost' was never ingested.*\['a'\]"):
        kv.admit_prefix("ghost", "t", [1, 2], ROOT)
    with pytest.raises(UnknownName, match="no stream"):
        kv.extend_tokens("a", "t", [1])
    assert not kv.streams and kv.prefix_stats.lookups == 0


def test_extend_tokens_needs_a_stream_started_from_the_cache():
    kv = make_kv()
    kv.ingest_request("a")
    run(kv, [("a", 3)], {"a": [1, 2, 3]})
    with pytest.raises(StateError, match="not started with admit_prefix"):
        kv.extend_tokens("a", "t", [4])


# -- steps in flight ----------------------------------------------------------------------------------


@pytest.mark.parametrize("land", ["commit", "rollback"])
@pytest.mark.parametrize("how", ["reset", "remove"])
def test_a_stream_reset_in_flight_gives_its_shared_pages_back_when_the_step_lands(land, how):
    kv = make_kv(max_pages=8, ps=4)
    prompt = list(range(1, 10))
    start(kv, "a", prompt)
    assert start(kv, "b", prompt) == 8
    shared = held(kv, "a")[:2]
    kv.remove_request("a")  # b alone holds the published pages now
    assert all(kv.pool._refs.get(p, 1) == 1 and p not in kv.pool._idle for p in shared)
    st, ctx, _ = begin(kv, [("b", 1)], {"b": [30]})
    parked = held(kv, "b")
    (kv.reset_request if how == "reset" else kv.remove_request)("b")
    # parked: nothing went idle or free, and the accounting counts the parked holder
    assert not set(parked) & (set(kv.pool._free) | set(kv.pool._idle))
    kv.post_warmup_validate()
    kv.ingest_request("c")
    assert kv.admit_prefix("c", "t", prompt, ROOT).cached_tokens == 8  # still findable
    assert held(kv, "c") == shared and all(kv.pool._refs[p] == 2 for p in shared)
    kv.reset_request("c")
    (kv.commit if land == "commit" else kv.rollback_admit)(st, ctx)
    assert not kv._parked
    assert list(kv.pool._idle)[-2:] == shared[::-1] and kv.pool.cached == 2
    assert not set(parked[2:]) & set(kv.pool._by_page) and set(parked[2:]) <= set(kv.pool._free)
    assert kv.num_free_pages == 8
    kv.post_warmup_validate()


# -- tensor parallel ----------------------------------------------------------------------------------


class RecordingTP:
    def __init__(self):
        self.checked = []

    def check_same(self, what, values):
        self.checked.append((what, dict(values)))


@pytest.mark.parametrize("cache", [True, False])
def test_tensor_parallel_checks_include_the_cached_pages(cache):
    tp = RecordingTP()
    kv = make_kv(prefix_cache=cache, tp=tp)
    kv.ingest_request("a")
    if cache:
        kv.admit_prefix("a", "t", list(range(1, 10)), ROOT)
    run(kv, [("a", 9)], {"a": list(range(1, 10))})
    kv.post_warmup_validate()
    (what, got), = tp.checked
    assert what == "kv" and got["free pages"] == 5 and got["tokens"] == 9
    if cache:
        assert got["cached pages"] == 2 and got["tokens found cached"] == 0
    else:
        assert "cached pages" not in got


def test_admit_reuses_a_match_only_while_it_still_holds():
    """The walk match_prefix made is reused by admit_prefix of the same list; a key published
    since, or the list changed since, makes admit walk again."""
    kv = make_kv(max_pages=12, ps=4)
    start(kv, "a", list(range(1, 10)))  # publishes [1..4], [5..8]
    p = list(range(1, 10)) + [50]
    assert kv.match_prefix(p, ROOT, "t") == 8
    start(kv, "q", list(range(1, 9)) + [9, 10, 11, 12, 99])  # publishes [9..12] below them
    kv.ingest_request("b")
    assert kv.admit_prefix("b", "t", p, ROOT).cached_tokens == 8  # walked again: same answer here
    p2 = list(range(1, 13)) + [7]
    assert kv.match_prefix(p2, ROOT, "t") == 12
    p2[5] = 77  # the list changed after the match
    kv.ingest_request("c")
    assert kv.admit_prefix("c", "t", p2, ROOT).cached_tokens == 4
    assert kv.stream("c", "t").chain.tokens == p2
    p3 = list(range(1, 13)) + [8]
    assert kv.match_prefix(p3, ROOT, "t") == 12
    kv.ingest_request("d")
    assert kv.admit_prefix("d", "t", p3, ROOT).cached_tokens == 12  # reused
    assert held(kv, "d") == held(kv, "q")[:3]
    kv.post_warmup_validate()
