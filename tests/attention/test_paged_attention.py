"""PagedAttentionManager over the KVManager, against the float64 oracle."""

import pytest
import torch

from mstar_core import (
    AttentionStep,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
    StepContext,
)
from mstar_core.backends import reference as R
from mstar_core.testing.oracle import attention_oracle, rel_error

from ..helpers import REF_WRAPPERS, small_kv, step


def make(dtype=torch.float64, **kw):
    kv = small_kv(max_pages=32, page_size=4, dtype=dtype, **kw)
    attn = PagedAttentionManager(kv, "cpu", dtype, kv.config, REF_WRAPPERS)
    return kv, attn, Node([attn, kv])


class History:
    """Every K/V a stream was given, to build the oracle's keys."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, key, k, v):
        self.k[key] = torch.cat([self.k[key], k]) if key in self.k else k
        self.v[key] = torch.cat([self.v[key], v]) if key in self.v else v


PLAIN_STEP = AttentionStep()


def run_layer0(node, kv, attn, hist, spans, attn_step=PLAIN_STEP, commit=True):
    step = Step(KVStep(tuple(KVSpan(r, lab, n, commit) for r, lab, n in spans)), attn_step)
    outs = {}

    def forward(ctx):
        plan = ctx.plan_results["kv"]
        for label, lay in plan.labels:
            n = lay.num_tokens
            q = torch.randn(n, kv.config.qo_heads, kv.config.head_dim, dtype=kv.dtype)
            k = torch.randn(n, kv.config.num_kv_heads, kv.config.head_dim, dtype=kv.dtype)
            v = torch.randn_like(k)
            if attn.requires_kv_write:
                kv.write_kv(k, v, 0, label)
            out = attn.run(q, label, kv.layer_view(0), k=k, v=v, layer_idx=0)
            for s in lay.spans:
                sl = slice(s.q_start, s.q_start + s.to_compute)
                key = (s.request_id, label)
                allk = torch.cat([hist.k.get(key, k[:0]), k[sl]])
                allv = torch.cat([hist.v.get(key, v[:0]), v[sl]])
                ref = attention_oracle(q[sl], allk, allv, attn_step.causal, attn_step.window_left, attn_step.sm_scale)
                outs[key] = rel_error(out[sl], ref)
                if s.commit:
                    hist.add(key, k[sl], v[sl])
        return outs

    res = node.step(step, forward)
    assert res.outcome
    return res.output, res.ctx.plan_results[attn.name]


def test_prefill_mixed_decode_steps_match_oracle():
    kv, attn, node = make()
    hist = History()
    for r in "abc":
        node.ingest_request(r)
    errs, plan = run_layer0(node, kv, attn, hist, [("a", "t", 7), ("b", "t", 4)])
    assert plan.entry("t").kind == "paged_prefill"
    errs2, plan = run_layer0(node, kv, attn, hist, [("a", "t", 1), ("b", "t", 1), ("c", "t", 9)])
    assert plan.entry("t").kind == "mixed"
    errs3, plan = run_layer0(node, kv, attn, hist, [("a", "t", 1), ("b", "t", 1), ("c", "t", 1)])
    assert plan.entry("t").kind == "paged_decode"
    for e in (errs, errs2, errs3):
        assert max(e.values()) < 1e-12, e


def test_two_labels_window_and_scale():
    kv, attn, node = make()
    hist = History()
    node.ingest_request("a")
    a = AttentionStep(causal=True, window_left=3, sm_scale=0.3)
    run_layer0(node, kv, attn, hist, [("a", "text", 6), ("a", "audio", 5)], a)
    errs, plan = run_layer0(node, kv, attn, hist, [("a", "text", 1), ("a", "audio", 2)], a)
    assert {e.label: e.kind for e in plan.entries} == {"text": "paged_decode", "audio": "paged_prefill"}
    assert max(errs.values()) < 1e-12


def test_run_rejects_bad_q():
    kv, attn, node = make(dtype=torch.float32)
    node.ingest_request("a")
    step = Step(KVStep((KVSpan("a", "t", 3),)))

    def forward(ctx):
        with pytest.raises(ValueError, match=r"q has shape \(3, 4, 16\), expected \(3, 4, 8\)"):
            attn.run(torch.zeros(3, 4, 16), "t", layer_idx=0)  # head_dim differs from the cache's
        with pytest.raises(ValueError, match=r"expected \(3, 4, 8\)"):
            attn.run(torch.zeros(2, 4, 8), "t", layer_idx=0)
        with pytest.raises(TypeError, match="dtype torch.float64, expected torch.float32"):
            attn.run(torch.zeros(3, 4, 8, dtype=torch.float64), "t", layer_idx=0)
        return attn.run(torch.zeros(3, 4, 8), "t", layer_idx=0)

    assert node.step(step, forward).output.shape == (3, 4, 8)


def test_missing_wrapper_is_named():
    kv = small_kv()
    with pytest.raises(ValueError, match=r"missing \['mixed'\]"):
        PagedAttentionManager(kv, "cpu", torch.float64, kv.config,
                              {k: v for k, v in REF_WRAPPERS.items() if k != "mixed"})


def test_requires_kv_write_and_slots_alternate():
    kv, attn, node = make()
    assert attn.requires_kv_write and attn.depends_on() == ("kv",)
    node.ingest_request("a")
    hist = History()
    _, p1 = run_layer0(node, kv, attn, hist, [("a", "t", 2)])
    _, p2 = run_layer0(node, kv, attn, hist, [("a", "t", 2)])
    # consecutive plans use different wrapper objects: step N+1's plan leaves step N's intact
    assert p1.entry("t").wrapper is not p2.entry("t").wrapper


def test_fingerprint_names_the_kernels_and_dtype():
    kv, attn, _ = make()
    _, attn32, _ = make(dtype=torch.float32)
    fp = attn.fingerprint()
    assert b"ReferenceDecodeWrapper" in fp and b"float64" in fp
    assert fp != attn32.fingerprint()  # pages computed in another dtype are not interchangeable


def test_fingerprint_says_which_wrapper_runs_multi_token_decode_rows():
    from mstar_core import AttentionFeatures, KVConfig, KVManager

    def fp(features, wrapper):
        kv = KVManager(KVConfig(2, 2, 8, 4, 32, 4), "cpu", torch.float64, features=features)
        return PagedAttentionManager(kv, "cpu", torch.float64, kv.config, REF_WRAPPERS,
                                     multi_token_wrapper=wrapper).fingerprint()

    multi = AttentionFeatures(decode_query_tokens=3)
    # the same kernels, the rows on another wrapper: pages written under one are not the other's
    assert fp(multi, "paged_decode") != fp(multi, "paged_prefill")
    # one-token decode: where multi-token rows would run changes nothing
    plain = AttentionFeatures()
    assert fp(plain, "paged_decode") == fp(plain, "paged_prefill")


def test_build_from_spec_selects_through_the_registry():
    from mstar_core import BuildInfo

    kv = small_kv(dtype=torch.float32)
    info = BuildInfo(torch.device("cpu"), torch.float32, num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=8,
                     built={"kv": kv})
    attn = PagedAttentionManager.build({"backend": "reference", "accelerator_graph": True}, info)
    assert attn.wrapper_classes["paged_decode"] is REF_WRAPPERS["paged_decode"]
    assert attn.graph_capturable is False  # the reference declares no capturable capability
    assert attn.can_capture()  # on a CPU the graph runner re-runs closures, which any backend supports
    with pytest.raises(ValueError, match="'nope'"):
        PagedAttentionManager.build({"backend": "nope"}, info)


def paged_node(wrappers=REF_WRAPPERS, **kw):
    kv = small_kv(max_pages=32, page_size=4)
    attn = PagedAttentionManager(kv, "cpu", torch.float64, kv.config, wrappers, **kw)
    return kv, attn, Node([kv, attn])


def commit_prefill(node, *spans):
    """Commit ``(rid, tokens)`` prompts of label "t" (the K/V content does not matter here)."""
    st = step(*((r, "t", n) for r, n in spans))
    assert node.step(st, lambda ctx: None).outcome


@pytest.mark.parametrize("prompts,kind", [((3,), "mixed"), ((3, 2), "mixed"), ((3, 2, 5), "paged_prefill")])
def test_mixed_step_uses_the_mixed_wrapper_up_to_max_prefill_rows(prompts, kind):
    """A step mixing one-token rows with prompt rows runs on the mixed wrapper while its prompt
    rows number at most ``max_prefill_rows`` (the boundary included); only more prompt rows than
    that fall back to one packed prefill plan."""
    kv, attn, node = paged_node(max_prefill_rows=2)
    rids = [f"p{i}" for i in range(len(prompts))]
    for r in ["d", *rids]:
        node.ingest_request(r)
    commit_prefill(node, ("d", 3))
    st = step(("d", "t", 1), *((r, "t", n) for r, n in zip(rids, prompts, strict=True)))
    ctx = StepContext()
    assert node.admit(st, ctx)
    node.plan(st, ctx)
    (entry,) = ctx.plan_results["attn"].entries
    assert entry.kind == kind
    assert entry.num_tokens == 1 + sum(prompts)
    node.rollback_admit(st, ctx)


def test_decode_step_applies_the_steps_window():
    """A decode-only step plans its wrapper with the step's ``window_left``: each one-token row
    sees only its last ``window_left + 1`` keys (checked against the oracle, and against the
    unwindowed result, which differs)."""
    kv, attn, node = paged_node()
    g = torch.Generator().manual_seed(3)
    hq, hkv, d = kv.config.qo_heads, kv.config.num_kv_heads, kv.config.head_dim
    lens = {"a": 9, "b": 6}
    keys = {r: (torch.randn(n, hkv, d, generator=g, dtype=torch.float64),
                torch.randn(n, hkv, d, generator=g, dtype=torch.float64)) for r, n in lens.items()}
    for r in lens:
        node.ingest_request(r)
    pre = step(*((r, "t", n) for r, n in lens.items()))

    def write_prefix(ctx):
        kv.write_kv(torch.cat([keys[r][0] for r in lens]), torch.cat([keys[r][1] for r in lens]), 0, "t")

    assert node.step(pre, write_prefix).outcome
    q = torch.randn(2, hq, d, generator=g, dtype=torch.float64)
    k1 = torch.randn(2, hkv, d, generator=g, dtype=torch.float64)
    v1 = torch.randn(2, hkv, d, generator=g, dtype=torch.float64)
    outs = {}
    for window in (2, -1):
        st = Step(KVStep((KVSpan("a", "t", 1, False), KVSpan("b", "t", 1, False))), AttentionStep(True, window))

        def forward(ctx):
            assert ctx.plan_results["attn"].entries[0].kind == "paged_decode"
            kv.write_kv(k1, v1, 0, "t")
            return attn.run(q, "t", layer_idx=0)

        outs[window] = node.step(st, forward).output
        for i, r in enumerate(lens):
            ref = attention_oracle(q[i:i + 1], torch.cat([keys[r][0], k1[i:i + 1]]),
                                   torch.cat([keys[r][1], v1[i:i + 1]]), True, window)
            assert rel_error(outs[window][i:i + 1], ref) < 1e-12, (window, r)
    assert rel_error(outs[2], outs[-1]) > 1e-3  # the window really cut keys off


class _FlakyPrefill(R.ReferencePrefillWrapper):
    fail = False

    def plan(self, *args, **kwargs):
        if type(self).fail:
            raise RuntimeError("planted plan failure")
        return super().plan(*args, **kwargs)


def test_a_failed_replan_leaves_the_wrappers_older_plan_unusable():
    """When a later step's plan of a wrapper fails, the step that wrapper was planned for before
    may not run on it any more (the wrapper may hold half of the new plan): its ``run`` is
    refused, not silently computed from a mixed state."""
    kv, attn, node = paged_node({**REF_WRAPPERS, "paged_prefill": _FlakyPrefill}, slots=2)
    for r in "abc":
        node.ingest_request(r)
    ctxs = []
    for r in "ab":  # slot 0, then slot 1
        st, ctx = step((r, "t", 3)), StepContext()
        assert node.admit(st, ctx)
        node.plan(st, ctx)
        ctxs.append((st, ctx))
    _FlakyPrefill.fail = True
    try:
        st3, ctx3 = step(("c", "t", 3)), StepContext()
        assert node.admit(st3, ctx3)
        with pytest.raises(RuntimeError, match="planted plan failure"):
            node.plan(st3, ctx3)  # slot 0 again: the wrapper step a planned
    finally:
        _FlakyPrefill.fail = False
    q = torch.zeros(3, kv.config.qo_heads, kv.config.head_dim, dtype=torch.float64)
    st_a, ctx_a = ctxs[0]
    with node.bound(ctx_a), pytest.raises(RuntimeError, match="re-planned by a later step"):
        attn.run(q, "t", layer_idx=0)
    with node.bound(ctxs[1][1]):
        assert attn.run(q, "t", layer_idx=0).shape == q.shape  # slot 1 was not touched
    for st, ctx in ctxs:
        node.rollback_admit(st, ctx)
