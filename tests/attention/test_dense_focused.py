"""Second, focused tests for DenseAttentionManager behaviours that only one other test pinned down
(issue 10): what ``run`` writes to the pages in a step mixing committed and fresh spans, the
gathered-prefix cache's LRU order, and the two wrapper slots that let a step be planned ahead."""

from __future__ import annotations

import torch

from mstar_core import (
    DenseAttentionManager,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    Step,
    StepContext,
)
from mstar_core.backends.reference import ReferencePrefixedPrefillWrapper
from mstar_core.testing.conformance import TOLERANCE

from ..helpers import LABEL, Harness

CFG = KVConfig(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, max_pages=16, num_qo_heads=4)


def dense_node(**kw):
    kv = KVManager(CFG, "cpu", torch.float32)
    attn = DenseAttentionManager(kv, "cpu", torch.float32, CFG, ReferencePrefixedPrefillWrapper, **kw)
    return kv, attn, Node([kv, attn])


def fresh(n, h, base):
    """Distinct, recognisable values: token i, head j, dim d holds ``base + 100 i + 10 j + d``."""
    t = torch.arange(n)[:, None, None] * 100 + torch.arange(h)[None, :, None] * 10 + torch.arange(CFG.head_dim)
    return (t + base).float()


def step_through(node, attn, spans, base=0.0):
    st = Step(KVStep(tuple(KVSpan(r, LABEL, n, c) for r, n, c in spans)))
    total = sum(n for _, n, _ in spans)
    kvs = {}

    def forward(ctx):
        for layer in range(CFG.num_layers):
            k = fresh(total, CFG.num_kv_heads, base + 1000 * layer)
            v = -k - 0.5
            kvs[layer] = (k, v)
            q = torch.randn(total, CFG.qo_heads, CFG.head_dim)
            attn.run(q, LABEL, k=k, v=v, layer_idx=layer)

    assert node.step(st, forward).outcome
    return kvs


def test_run_writes_only_committed_spans_k_and_v_to_their_pages():
    """In a step mixing ``commit=True`` and ``commit=False`` spans, ``run`` writes the committed
    span's K to the K half and its V to the V half of its pages, at every layer, and writes none
    of the fresh tokens — not even into the free slots of pages their stream keeps."""
    kv, attn, node = dense_node()
    for r in "ab":
        node.ingest_request(r)
    step_through(node, attn, [("b", 5, True)])  # b keeps 2 pages, slots 1..3 of the second free
    b_pages = list(kv.stream("b", LABEL).pages)
    before = kv.storage[:, b_pages].clone()
    kvs = step_through(node, attn, [("a", 6, True), ("b", 3, False)], base=7.0)
    a = kv.stream("a", LABEL)
    assert a.length == 6 and kv.stream("b", LABEL).length == 5
    for layer in range(CFG.num_layers):
        k, v = kvs[layer]
        view = kv.layer_view(layer)
        got_k = torch.cat([view[p, 0] for p in a.pages])[:6]
        got_v = torch.cat([view[p, 1] for p in a.pages])[:6]
        assert torch.equal(got_k, k[:6]), f"layer {layer}: K of the committed span"
        assert torch.equal(got_v, v[:6]), f"layer {layer}: V of the committed span"
    assert torch.equal(kv.storage[:, b_pages], before), "fresh (commit=False) tokens were written"
    assert kv.storage[:, b_pages[1], :, 1:].abs().sum() == 0


def test_a_cache_hit_makes_the_entry_most_recently_used():
    """The gathered-prefix cache's bound evicts the least recently *used* entries: a stream whose
    prefix was read again (a hit) outlives one gathered after it but not read since."""
    layers = 2
    h = Harness(lambda kv, cfg: DenseAttentionManager(kv, kv.device, kv.dtype, cfg, ReferencePrefixedPrefillWrapper,
                                                      max_cached_tokens=layers * 2 * 16),
                layers=layers, d=8, page_size=4)
    h.ingest("a", "b", "c")
    h.step([("a", 16, True), ("b", 16, True), ("c", 16, True)])
    st = h.attn.stats
    h.step([("a", 2, False)])  # gathers a
    h.step([("b", 2, False)])  # gathers b
    err, _ = h.step([("a", 2, False)])  # hits: a is now more recent than b
    assert (st.gathers, st.hits) == (2 * layers, layers)
    h.step([("c", 2, False)])  # over the bound: b's entries go, not a's
    assert h.attn.cached_streams() == {("a", LABEL), ("c", LABEL)} and st.evictions == layers
    err, _ = h.step([("a", 2, False)])
    assert err < TOLERANCE[torch.float32]
    assert st.gathers == 3 * layers, "a was evicted although it was used after b"


def test_a_step_planned_ahead_runs_on_its_own_wrapper():
    """Consecutive plans alternate between two wrapper slots: a step planned while the previous
    one has not run yet (prepare N+1 before launch N) leaves that one's wrapper alone, so both
    run, each on its own plan."""
    kv, attn, node = dense_node()
    for r in "ab":
        node.ingest_request(r)
    step_through(node, attn, [("a", 6, True), ("b", 3, True)])
    steps = [Step(KVStep((KVSpan("a", LABEL, 2, False),))), Step(KVStep((KVSpan("b", LABEL, 5, False),)))]
    ctxs = [StepContext(), StepContext()]
    for st, ctx in zip(steps, ctxs):
        assert node.admit(st, ctx)
        node.plan(st, ctx)
    for st, ctx, n in zip(steps, ctxs, (2, 5)):
        q = torch.randn(n, CFG.qo_heads, CFG.head_dim)
        k = torch.randn(n, CFG.num_kv_heads, CFG.head_dim)
        with node.bound(ctx):
            out = attn.run(q, LABEL, k=k, v=k, layer_idx=0)
        assert out.shape == (n, CFG.qo_heads, CFG.head_dim) and torch.isfinite(out).all()
        node.commit(st, ctx)
