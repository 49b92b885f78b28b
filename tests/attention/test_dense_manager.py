"""DenseAttentionManager end to end with the KVManager, against the float64 oracle; the
gathered-prefix cache (reuse, invalidation on a generation bump, reset/remove, LRU bound); the
resource contract; clear errors."""

from __future__ import annotations

import pytest
import torch

from mstar_core import (
    DenseAttentionManager,
    DensePlan,
    DenseSegment,
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

from ..helpers import LABEL, Harness, dense

F32 = TOLERANCE[torch.float32]
CFG = KVConfig(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, max_pages=16, num_qo_heads=4)


def denoise_setup(h: Harness) -> None:
    """Prefixes of 40 (ends mid-page), 32 (page boundary) and 0 tokens, committed."""
    h.ingest("a", "b", "c")
    err, _ = h.step([("a", 40, True), ("b", 32, True)])
    assert err < TOLERANCE[h.dtype]


BACKENDS = [
    pytest.param("reference", torch.float32, id="reference-f32"),
    pytest.param("fa3", torch.bfloat16, id="fa3-standin-bf16"),
    pytest.param("fa3-lse", torch.bfloat16, id="fa3-standin-out_lse-bf16"),
    pytest.param("aiter", torch.bfloat16, id="aiter-standin-bf16"),
]


@pytest.mark.parametrize("which,dtype", BACKENDS)
def test_denoise_steps_match_full_attention(which, dtype, request):
    if which.startswith("fa3"):
        request.getfixturevalue("fa3_standin").RETURN_LSE_ALWAYS = which == "fa3-lse"
        from mstar_fa3.ragged import FA3PrefixedPrefillWrapper as W
    elif which == "aiter":
        request.getfixturevalue("aiter_standin")
        from mstar_rocm.ragged import AiterPrefixedPrefillWrapper as W
    else:
        W = ReferencePrefixedPrefillWrapper
    h = Harness(dense(W), dtype)
    denoise_setup(h)
    for _ in range(3):
        err, _ = h.step([("a", 48, False), ("b", 17, False), ("c", 5, False)])
        assert err < TOLERANCE[dtype]
    # commit=False left the committed lengths and the page holdings as they were
    assert h.kv.stream("a", LABEL).length == 40 and len(h.kv.stream("a", LABEL).pages) == 3
    assert h.kv.stream("c", LABEL).length == 0 and not h.kv.stream("c", LABEL).pages


def test_plan_reads_the_kv_plan():
    h = Harness(dense())
    denoise_setup(h)
    step = Step(KVStep((KVSpan("a", LABEL, 7, False), KVSpan("b", LABEL, 3, False))))
    ctx = StepContext()
    assert h.node.admit(step, ctx)
    ctx.plan_results["kv"] = h.kv.plan(step, ctx)
    plan = h.attn.plan(step, ctx)
    assert isinstance(plan, DensePlan) and plan.wrapper is not None
    sa = h.kv.stream("a", LABEL)
    assert plan.segments == (
        DenseSegment("a", LABEL, tuple(sa.pages[:3]), 40, 7, sa.generation),
        DenseSegment("b", LABEL, tuple(h.kv.stream("b", LABEL).pages[:2]), 32, 3, h.kv.stream("b", LABEL).generation),
    )
    assert plan.cu_q == (0, 7, 10) and plan.cu_k == (0, 47, 82) and (plan.max_q, plan.max_k) == (7, 47)
    assert plan.causal is True
    with pytest.raises(AttributeError):
        plan.max_q = 1  # frozen
    h.kv.rollback_admit(step, ctx)


def test_causal_chunks_committed_by_the_dense_manager():
    """commit=True spans are written to the pages by run itself, so a later chunk attends them."""
    h = Harness(dense())
    h.ingest("a", "b")
    for chunk in ((19, 5), (16, 30), (1, 1)):
        err, _ = h.step([("a", chunk[0], True), ("b", chunk[1], True)], causal=True)
        assert err < F32
    assert h.kv.stream("a", LABEL).length == 36
    # the pages hold exactly the committed K: compare with the truth
    for layer in range(h.cfg.num_layers):
        st = h.kv.stream("a", LABEL)
        blk = h.kv.layer_view(layer)[st.pages]  # [n, 2, ps, H, D]
        k = blk[:, 0].reshape(-1, h.cfg.num_kv_heads, h.cfg.head_dim)[: st.length]
        assert torch.equal(k.double(), h.truth[("a", LABEL, layer)][0])


def test_mixed_commit_writes_only_committed_spans():
    h = Harness(dense())
    h.ingest("a", "b")
    h.step([("a", 20, True), ("b", 20, True)])
    before = h.kv.storage.clone()
    err, _ = h.step([("a", 5, True), ("b", 9, False)], causal=True)
    assert err < F32
    sb = h.kv.stream("b", LABEL)
    assert sb.length == 20
    # b's pages (the committed ones) unchanged; a's new slots written
    assert torch.equal(h.kv.storage[:, sb.pages], before[:, sb.pages])
    sa = h.kv.stream("a", LABEL)
    assert sa.length == 25
    err, _ = h.step([("a", 3, False), ("b", 2, False)])
    assert err < F32


def test_prefix_gathered_once_per_stream_and_layer():
    h = Harness(dense())
    denoise_setup(h)
    st = h.attn.stats
    layers = h.cfg.num_layers
    h.step([("a", 8, False), ("b", 8, False), ("c", 8, False)])
    assert (st.gathers, st.hits) == (2 * layers, 0)  # c has no prefix: nothing to gather
    for i in range(3):
        h.step([("a", 8, False), ("b", 8, False), ("c", 8, False)])
        assert (st.gathers, st.hits) == (2 * layers, 2 * layers * (i + 1))
    assert h.attn.cached_streams() == {("a", LABEL), ("b", LABEL)}
    assert h.attn.cached_prefix_tokens == layers * (40 + 32)


def test_generation_bump_invalidates_the_gathered_prefix():
    """Rewrite a's prefix pages in place (as a page-table move would) and bump its generation:
    the next step gathers anew and matches the new truth. Without the bump the stale copy is
    used — which shows the cache really is read, and why the generation is the key."""
    h = Harness(dense())
    denoise_setup(h)
    h.step([("a", 8, False), ("b", 8, False)])
    st = h.attn.stats
    gathers = st.gathers
    sa = h.kv.stream("a", LABEL)
    newk = torch.randn((len(sa.pages), 2, h.cfg.page_size, h.cfg.num_kv_heads, h.cfg.head_dim), generator=h.gen)
    h.kv.storage[:, sa.pages] = newk
    for layer in range(h.cfg.num_layers):
        flat = newk.transpose(0, 1).reshape(2, -1, h.cfg.num_kv_heads, h.cfg.head_dim)[:, :40].double()
        h.truth[("a", LABEL, layer)] = (flat[0], flat[1])

    err, _ = h.step([("a", 8, False), ("b", 8, False)])
    assert err > 1e-2  # stale: same generation, same pages
    h.kv.invalidate_stream("a", LABEL)
    err, _ = h.step([("a", 8, False), ("b", 8, False)])
    assert err < F32
    assert st.gathers == gathers + h.cfg.num_layers and st.invalidations == h.cfg.num_layers


def test_reset_and_recommit_rebuilds():
    h = Harness(dense())
    denoise_setup(h)
    h.step([("a", 8, False), ("b", 8, False)])
    st = h.attn.stats
    h.reset("b")
    assert ("b", LABEL) not in h.attn.cached_streams() and st.dropped == h.cfg.num_layers
    h.step([("b", 21, True)])
    err, _ = h.step([("a", 8, False), ("b", 8, False)])
    assert err < F32
    assert st.gathers == 3 * h.cfg.num_layers


def test_remove_request_frees_prefixes_and_is_idempotent():
    h = Harness(dense())
    denoise_setup(h)
    h.step([("a", 8, False), ("b", 8, False)])
    h.node.remove_request("a")
    assert h.attn.cached_streams() == {("b", LABEL)}
    assert h.attn.cached_prefix_tokens == 32 * h.cfg.num_layers
    h.node.remove_request("a")  # unknown now: no-op
    h.attn.remove_request("never-seen")


def test_ingest_is_idempotent():
    h = Harness(dense())
    h.attn.ingest_request("a", {"x": 1})
    h.attn.ingest_request("a", {"x": 2})
    assert h.attn._requests == {"a": {"x": 1}}


def test_lru_bound_evicts_least_recent():
    h = Harness(dense(max_cached_tokens=2 * 40))
    denoise_setup(h)
    err, _ = h.step([("a", 8, False), ("b", 8, False)])
    assert err < F32  # evictions never change results
    st = h.attn.stats
    assert h.attn.cached_prefix_tokens <= 80 and st.evictions > 0
    err, _ = h.step([("a", 8, False), ("b", 8, False)])
    assert err < F32


def test_two_labels_in_one_step():
    h = Harness(dense())
    h.ingest("a", "b")
    h.step([("a", "text", 12, True), ("a", "latent", 20, True), ("b", "latent", 7, True)])
    err, _ = h.step([("a", "text", 3, False), ("a", "latent", 9, False), ("b", "latent", 4, False)])
    assert err < F32
    plan = h.attn._current  # the last step's plan (it has landed: not current)
    assert plan.wrapper is None and [s.label for s in plan.segments] == ["text", "latent", "latent"]


def test_resource_contract():
    h = Harness(dense())
    a = h.attn
    assert a.requires_kv_write is False
    assert a.can_capture() is False
    assert a.force_double_buffer is False
    assert a.depends_on() == ("kv",)
    fp = a.fingerprint()
    assert isinstance(fp, bytes) and b"ReferencePrefixedPrefillWrapper" in fp

    class Other(ReferencePrefixedPrefillWrapper):
        pass

    assert DenseAttentionManager(h.kv, "cpu", h.dtype, h.cfg, Other).fingerprint() != fp
    by_name = DenseAttentionManager(h.kv, "cpu", h.dtype, h.cfg,
                                    "mstar_core.backends.reference:ReferencePrefixedPrefillWrapper")
    assert by_name.wrapper_class is ReferencePrefixedPrefillWrapper


def test_build_from_spec():
    from mstar_core import BuildInfo

    h = Harness(dense())
    info = BuildInfo(torch.device("cpu"), h.dtype, h.cfg.num_layers, h.cfg.qo_heads, h.cfg.num_kv_heads,
                     h.cfg.head_dim, built={"kv": h.kv})
    m = DenseAttentionManager.build({"wrapper_class": ReferencePrefixedPrefillWrapper, "max_cached_tokens": 5}, info)
    assert m.wrapper_class is ReferencePrefixedPrefillWrapper and m.max_cached_tokens == 5
    m = DenseAttentionManager.build({"backend": "reference"}, info)
    assert m.wrapper_class is ReferencePrefixedPrefillWrapper


def test_run_errors():
    h = Harness(dense())
    a = h.attn
    q = torch.randn(8, 4, 32)
    kv = torch.randn(8, 2, 32)
    with pytest.raises(RuntimeError, match="no step is planned"):
        a.run(q, LABEL, k=kv, v=kv, layer_idx=0)
    denoise_setup(h)
    step = Step(KVStep((KVSpan("a", LABEL, 8, False),)))
    ctx = StepContext()
    h.node.admit(step, ctx)
    ctx.plan_results["kv"] = h.kv.plan(step, ctx)
    a.plan(step, ctx)
    with pytest.raises(ValueError, match=r"q has shape \(7, 4, 32\), expected \(8, 4, 32\)"):
        a.run(q[:7], LABEL, k=kv, v=kv, layer_idx=0)
    with pytest.raises(TypeError, match="q has dtype torch.float64, expected torch.float32"):
        a.run(q.double(), LABEL, k=kv, v=kv, layer_idx=0)
    with pytest.raises(ValueError, match="k is None"):
        a.run(q, LABEL, v=kv, layer_idx=0)
    with pytest.raises(ValueError, match=r"v has shape \(8, 4, 32\), expected \(8, 2, 32\)"):
        a.run(q, LABEL, k=kv, v=torch.randn(8, 4, 32), layer_idx=0)
    with pytest.raises(TypeError, match="k has dtype torch.float16"):
        a.run(q, LABEL, k=kv.half(), v=kv, layer_idx=0)
    with pytest.raises(ValueError, match="needs layer_idx"):
        a.run(q, LABEL, k=kv, v=kv)
    with pytest.raises(KeyError, match="'text' is not in this step"):
        a.run(q, "text", k=kv, v=kv, layer_idx=0)
    out = a.run(q, None, k=kv, v=kv, layer_idx=0)  # one label: None is fine
    assert out.shape == q.shape
    with pytest.raises(RuntimeError, match="needs the KV plan"):
        a.plan(step, StepContext())
    h.kv.rollback_admit(step, ctx)


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
    for st, ctx in zip(steps, ctxs, strict=True):
        assert node.admit(st, ctx)
        node.plan(st, ctx)
    for st, ctx, n in zip(steps, ctxs, (2, 5), strict=True):
        q = torch.randn(n, CFG.qo_heads, CFG.head_dim)
        k = torch.randn(n, CFG.num_kv_heads, CFG.head_dim)
        with node.bound(ctx):
            out = attn.run(q, LABEL, k=k, v=k, layer_idx=0)
        assert out.shape == (n, CFG.qo_heads, CFG.head_dim) and torch.isfinite(out).all()
        node.commit(st, ctx)
