"""PagedAttentionManager over the KVManager, against the float64 oracle."""

import pytest
import torch

from mstar_core import AttentionStep, KVSpan, KVStep, Node, PagedAttentionManager, Step
from mstar_core.testing.oracle import attention_oracle, rel_error

from ..helpers import REF_WRAPPERS, small_kv


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


def run_layer0(node, kv, attn, hist, spans, attn_step=AttentionStep(), commit=True):
    step = Step(KVStep(tuple(KVSpan(r, l, n, commit) for r, l, n in spans)), attn_step)
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
    return res.output, attn.current


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
