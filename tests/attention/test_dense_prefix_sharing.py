"""The dense path over a KV manager with the prefix cache on: streams started from the same cached
pages share one gathered entry per layer (keyed by the prefix cache's node and the pages); the
outputs are those of the same steps without the prefix cache; a prefix past the cached pages stays
the stream's own, and a stream that computed cached pages again shares them once it took them."""

from __future__ import annotations

import torch

from mstar_core import (
    AttentionStep,
    DenseAttentionManager,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    Step,
)
from mstar_core.backends.reference import ReferencePrefixedPrefillWrapper
from mstar_core.testing.conformance import TOLERANCE

from ..helpers import LABEL, Harness, dense

F32 = TOLERANCE[torch.float32]
PROMPT = list(range(100, 132))  # two full pages of 16 tokens


class CachedHarness(Harness):
    """The Harness over a KV manager with the prefix cache on; ``admit`` starts a stream from it."""

    def __init__(self, make_attn=None, **kw) -> None:
        make_attn = make_attn or dense()
        super().__init__(make_attn, **kw)
        self.kv = KVManager(self.cfg, self.device, self.dtype, features=self.features, prefix_cache=True)
        self.attn = make_attn(self.kv, self.cfg)
        self.node = Node([self.kv, self.attn])

    def admit(self, rid: str, tokens: list[int], source: str | None = None) -> int:
        """Ingest ``rid`` and start it from the cache: the tokens found cached hold ``source``'s
        K/V (its truth's first tokens). Returns how many were found."""
        self.ingest(rid)
        n = self.kv.admit_prefix(rid, LABEL, tokens).cached_tokens
        if n:
            assert source is not None
            for layer in range(self.cfg.num_layers):
                k, v = self.truth[(source, LABEL, layer)]
                self.truth[(rid, LABEL, layer)] = (k[:n], v[:n])
        return n

    def segments(self, spans):
        """The dense segments a step of ``spans`` gets (the step is run, so it must be valid)."""
        self.step(spans)
        return {s.request_id: s for s in self.attn._current.segments}


def test_streams_from_one_cached_prefix_gather_it_once_per_layer():
    h = CachedHarness()
    layers = h.cfg.num_layers
    assert h.admit("a", PROMPT) == 0
    err, _ = h.step([("a", 32, True)])  # a's prefill, committed through the dense manager: its pages are published
    assert err < F32
    a = h.kv.stream("a", LABEL)
    assert a.chain.keyed == 2
    for r in "bc":
        assert h.admit(r, [*PROMPT, 7], "a") == 32  # the last token is always computed: 32 of 33
        assert h.kv.stream(r, LABEL).pages == a.pages
    st = h.attn.stats
    err, _ = h.step([("a", 8, False), ("b", 5, False), ("c", 9, False)])
    assert err < F32
    assert (st.gathers, st.hits) == (layers, 2 * layers)  # one gather per layer, shared by a, b and c
    seg = h.attn._current.segments
    shared = (a.chain.node, 32, tuple(a.pages))
    assert all(s.shared == shared for s in seg)
    assert h.attn.prefixes.shared() == {shared: {("a", LABEL), ("b", LABEL), ("c", LABEL)}}
    assert h.attn.cached_prefix_tokens == layers * 32  # counted once
    assert h.attn.cached_streams() == {("a", LABEL), ("b", LABEL), ("c", LABEL)}
    for i in range(2):
        err, _ = h.step([("a", 8, False), ("b", 5, False), ("c", 9, False)])
        assert err < F32
        assert (st.gathers, st.hits) == (layers, 2 * layers + 3 * layers * (i + 1))
    assert st.invalidations == st.evictions == st.dropped == 0


def adopt(h: CachedHarness, rid: str, source: str, n: int) -> None:
    """``rid`` computed its first ``n`` tokens again and took ``source``'s published pages for
    them: from now on it reads ``source``'s K/V there (the same tokens' K/V, in a real model)."""
    for layer in range(h.cfg.num_layers):
        k, v = h.truth[(rid, LABEL, layer)]
        sk, sv = h.truth[(source, LABEL, layer)]
        h.truth[(rid, LABEL, layer)] = (torch.cat([sk[:n], k[n:]]), torch.cat([sv[:n], v[n:]]))


def test_a_stream_that_computed_cached_pages_again_shares_them_and_the_rest_stays_its_own():
    h = CachedHarness()
    layers = h.cfg.num_layers
    h.admit("a", PROMPT)
    h.admit("g", PROMPT)  # the same prompt, before a's pages are published: g computes them again
    h.ingest("f")  # no tokens given: no place in the prefix cache
    err, _ = h.step([("a", 32, True), ("g", 32, True), ("f", 20, True)])
    assert err < F32
    a, g, f = (h.kv.stream(r, LABEL) for r in "agf")
    assert g.pages == a.pages and not set(f.pages) & set(a.pages)  # g took a's pages for its copies
    adopt(h, "g", "a", 32)
    assert h.admit("d", [*PROMPT, *range(8)], "a") == 32
    st = h.attn.stats
    err, _ = h.step([("d", 8, True)])  # its prefix of 32 tokens: the shared pages, gathered now
    assert err < F32 and st.gathers == layers
    segs = h.segments([("a", 4, False), ("g", 3, False), ("f", 5, False), ("d", 6, False)])
    shared = (a.chain.node, 32, tuple(a.pages))
    assert segs["a"].shared == segs["g"].shared == segs["d"].shared == shared
    assert segs["f"].shared is None
    # per layer: the shared pages once, f's own 20 and d's own last 8 tokens
    assert st.gathers == 3 * layers
    assert h.attn.cached_prefix_tokens == layers * (32 + 20 + 8)
    err, _ = h.step([("a", 4, False), ("g", 3, False), ("f", 5, False), ("d", 6, False)])
    assert err < F32
    assert st.gathers == 3 * layers


def test_the_copies_a_stream_gave_back_serve_another_prompt_correctly():
    """g computes the cached prompt again and takes a's pages; its copies go back to the pool and
    are handed to x, with other tokens: x's prefix comes from its own K/V, not anything gathered."""
    h = CachedHarness()
    for r in ("a", "g"):
        h.admit(r, PROMPT)
    h.step([("a", 32, True)])
    h.step([("g", 32, True)])
    adopt(h, "g", "a", 32)
    err, _ = h.step([("g", 4, False)])
    assert err < F32
    h.admit("x", list(range(500, 532)))
    h.step([("x", 32, True)])
    assert set(h.kv.stream("x", LABEL).pages).isdisjoint(h.kv.stream("a", LABEL).pages)
    err, _ = h.step([("x", 4, False), ("g", 4, False)])
    assert err < F32


def test_only_the_leading_pages_found_cached_are_shared():
    """A stream whose first page was found cached and whose second another stream published while
    both computed it shares both once it took that page; a stream that found only the first page
    shares the first page only."""
    h = CachedHarness()
    h.admit("a", PROMPT[:16] + [1])  # publishes the first page
    h.step([("a", 17, True)])
    assert h.admit("b", PROMPT, "a") == 16
    h.admit("c", PROMPT, "a")
    err, _ = h.step([("b", 16, True), ("c", 16, True)])  # both compute the second page; b publishes it
    assert err < F32
    a, b, c = (h.kv.stream(r, LABEL) for r in "abc")
    assert c.pages == b.pages and c.pages[0] == a.pages[0]
    adopt(h, "c", "b", 32)
    segs = h.segments([("a", 2, False), ("b", 2, False), ("c", 2, False)])
    assert segs["b"].shared == segs["c"].shared == (b.chain.node, 32, tuple(b.pages))
    assert segs["a"].shared[1:] == (16, (a.pages[0],)) and segs["a"].shared[0] != b.chain.node
    err, _ = h.step([("a", 2, False), ("b", 2, False), ("c", 2, False)])
    assert err < F32


def test_removing_a_request_keeps_the_shared_prefix_of_the_others():
    h = CachedHarness()
    layers = h.cfg.num_layers
    h.admit("a", PROMPT)
    h.step([("a", 32, True)])
    for r in "bc":
        h.admit(r, [*PROMPT, 7], "a")
    h.step([("a", 8, False), ("b", 8, False), ("c", 8, False)])
    st = h.attn.stats
    h.node.remove_request("a")
    h.reset("b")
    assert st.dropped == 0 and h.attn.cached_streams() == {("c", LABEL)}
    err, _ = h.step([("c", 8, False)])
    assert err < F32 and st.gathers == layers  # c still hits the entry a gathered
    h.node.remove_request("c")  # its last user
    assert st.dropped == layers and h.attn.cached_prefix_tokens == 0 and h.attn.prefixes.shared() == {}


def test_a_fork_shares_and_leaves_the_shared_entry_alone():
    """A fork bumps its source's generation: the source's own entry would be rebuilt, the shared
    pages' entry is kept (they are published, never written); the fork shares it too."""
    h = CachedHarness()
    layers = h.cfg.num_layers
    h.admit("a", PROMPT)
    h.step([("a", 32, True)])
    h.step([("a", 8, False)])
    st = h.attn.stats
    h.ingest("b")
    assert h.kv.fork("a", "b", LABEL)
    for layer in range(layers):
        h.truth[("b", LABEL, layer)] = h.truth[("a", LABEL, layer)]
    err, _ = h.step([("a", 8, False), ("b", 8, False)])
    assert err < F32 and st.gathers == layers and st.invalidations == 0


def test_the_bound_counts_a_shared_prefix_once():
    layers = 2
    h = CachedHarness(dense(max_cached_tokens=layers * 32), layers=layers)
    h.admit("a", PROMPT)
    h.step([("a", 32, True)])
    for r in "bcd":
        h.admit(r, [*PROMPT, 7], "a")
    for _ in range(2):
        err, _ = h.step([("a", 8, False), ("b", 8, False), ("c", 8, False), ("d", 8, False)])
        assert err < F32
    st = h.attn.stats
    assert st.evictions == 0 and st.gathers == layers and h.attn.cached_prefix_tokens == layers * 32


# -- the same steps with and without the prefix cache ----------------------------------------------

CFG = KVConfig(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, max_pages=64, num_qo_heads=4)
TOKENS = list(range(50, 62))  # three pages of four


def committed(pos: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of a committed token: a function of its position and layer only, so a stream that
    computes the cached tokens again writes the very values the cache holds."""
    x = pos[:, None, None] * 0.37 + torch.arange(CFG.num_kv_heads)[None, :, None] * 0.11 \
        + torch.arange(CFG.head_dim)[None, None, :] * 0.05 + layer
    return torch.sin(x), torch.cos(1.3 * x)


class Driver:
    def __init__(self, prefix_cache: bool) -> None:
        self.kv = KVManager(CFG, "cpu", torch.float32, prefix_cache=prefix_cache)
        self.attn = DenseAttentionManager(self.kv, "cpu", torch.float32, CFG, ReferencePrefixedPrefillWrapper)
        self.node = Node([self.kv, self.attn])
        self.steps = 0

    def step(self, spans, causal=False) -> list[torch.Tensor]:
        """Run ``spans`` ``(rid, n, commit)``; committed tokens get :func:`committed` K/V, fresh
        ones random values that depend only on how many steps ran before."""
        outs: list[torch.Tensor] = []
        gen = torch.Generator().manual_seed(self.steps)
        self.steps += 1
        starts = [self.kv.streams[(r, LABEL)].length if (r, LABEL) in self.kv.streams else 0 for r, _, _ in spans]
        total = sum(n for _, n, _ in spans)

        def forward(ctx):
            for layer in range(CFG.num_layers):
                q = torch.randn(total, CFG.qo_heads, CFG.head_dim, generator=gen)
                k = torch.randn(total, CFG.num_kv_heads, CFG.head_dim, generator=gen)
                v = torch.randn(total, CFG.num_kv_heads, CFG.head_dim, generator=gen)
                at = 0
                for (_, n, commit), start in zip(spans, starts, strict=True):
                    if commit:
                        k[at:at + n], v[at:at + n] = committed(torch.arange(start, start + n), layer)
                    at += n
                outs.append(self.attn.run(q, LABEL, k=k, v=v, layer_idx=layer))

        step = Step(KVStep(tuple(KVSpan(r, LABEL, n, c) for r, n, c in spans)), AttentionStep(causal))
        assert self.node.step(step, forward).outcome
        return outs


def test_outputs_equal_those_without_the_prefix_cache():
    cached, plain = Driver(True), Driver(False)
    for d in (cached, plain):
        for r in "abcde":
            d.node.ingest_request(r)
    # with the cache: a computes the prompt, b and c find it all, d finds it and adds part of a
    # page, e has a prompt of its own
    assert cached.kv.admit_prefix("a", LABEL, TOKENS).cached_tokens == 0
    cached.step([("a", 12, True), ("e", 7, True)], causal=True)
    for r in "bc":
        assert cached.kv.admit_prefix(r, LABEL, [*TOKENS, 1]).cached_tokens == 12
    assert cached.kv.admit_prefix("d", LABEL, [*TOKENS, *range(3)]).cached_tokens == 12
    cached.step([("d", 3, True)], causal=True)
    # without: every stream computes its whole prompt, writing the same values
    plain.step([("a", 12, True), ("e", 7, True)], causal=True)
    plain.step([("b", 12, True), ("c", 12, True), ("d", 15, True)], causal=True)
    for r in "abcde":
        assert cached.kv.stream(r, LABEL).length == plain.kv.stream(r, LABEL).length
    fresh = [("a", 5, False), ("b", 3, False), ("c", 6, False), ("d", 2, False), ("e", 4, False)]
    cached.steps = plain.steps = 10
    gathers = cached.attn.stats.gathers, plain.attn.stats.gathers
    for _ in range(3):
        for got, want in zip(cached.step(fresh), plain.step(fresh), strict=True):
            assert torch.equal(got, want)
    layers = CFG.num_layers
    # per layer, with the cache: d's own tail and e's prefix (d's step gathered the shared prompt);
    # without: one per stream
    assert cached.attn.stats.gathers - gathers[0] == 2 * layers
    assert plain.attn.stats.gathers - gathers[1] == 5 * layers
    assert cached.attn.cached_prefix_tokens == layers * (12 + 3 + 7)
    assert plain.attn.cached_prefix_tokens == layers * (4 * 12 + 3 + 7)
