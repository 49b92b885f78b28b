"""What the paged managers hand each wrapper, per layer and per layer group, as spy wrappers
record it (tests/plan_spies.py): the plan a layer's run reads carries that layer's sink flag,
window, soft cap, scale, KV dtype and page size, and its run gets that layer's sinks, FP8 scales
and KV layer. The reference on a CPU takes sinks at run and ignores the plan's sink flag, so its
outputs alone cannot show a kernel that builds per flag being handed the wrong one."""

from __future__ import annotations

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    AttentionStep,
    GroupedPagedAttentionManager,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
    build_paged_attention,
)
from mstar_core.attention.paged import plan_variants

from .. import plan_spies as spies
from ..group_fakes import FAKE, WRAPPERS, install_group_backend

LAYERS, HKV, HQ, D, PAGE = 4, 2, 4, 8, 4
SINKS = (True, False, True, False)
WINDOWS = (3, 3, 3, -1)  # with SINKS: three plans, layers 0 and 2 sharing one
# a prompt step, a mixed step (one decode row, one prompt row), a decode step
SCHEDULE = [[("a", 6), ("b", 3)], [("a", 1), ("b", 4)], [("a", 1), ("b", 1)]]
KINDS = ["paged_prefill", "mixed", "paged_decode"]
PLAIN_STEP = AttentionStep()


def _kv(features):
    cfg = KVConfig(LAYERS, HKV, D, PAGE, 32, HQ)
    return KVManager(cfg, "cpu", torch.float32, features=features), cfg


def drive(kv, attn, features, attn_step=PLAIN_STEP):
    """SCHEDULE's steps through every layer (each sink layer with its sinks); per step, the plans
    made for it and per layer the one run it made; and the sinks."""
    node = Node([kv, attn])
    for r in "ab":
        node.ingest_request(r)
    g = torch.Generator().manual_seed(0)
    sinks = [torch.randn(HQ, generator=g) for _ in range(LAYERS)]
    steps = []
    for spans in SCHEDULE:
        planned = len(spies.PLANS)

        def forward(ctx, planned=planned):
            ((label, lay),) = ctx.plan_results["kv"].labels
            n, runs = lay.num_tokens, []
            for i in range(LAYERS):
                q = torch.randn(n, HQ, D, generator=g)
                kv.write_kv(torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g), i, label)
                before = len(spies.RUNS)
                attn.run(q, label, kv.layer_view(i), layer_idx=i, sinks=sinks[i] if features.layer_sinks(i) else None)
                assert len(spies.RUNS) == before + 1  # one wrapper run per layer
                runs.append(spies.RUNS[-1])
            return spies.PLANS[planned:], runs

        res = node.step(Step(KVStep(tuple(KVSpan(r, "t", n) for r, n in spans)), attn_step), forward)
        steps.append(res.output)
    return steps, sinks


def check_runs(steps, sinks, kv, features, attn_step):
    """Every layer's run reads a plan of its own window and sink need, the features' soft cap, the
    step's scale, the cache's dtype and pages, on a wrapper of the layout's heads and head dim;
    and gets its own sinks, FP8 scales and KV layer."""
    kv_type = kv.kv_dtype if features.quantized else None
    for (_, runs), kind in zip(steps, KINDS, strict=True):
        for i, r in enumerate(runs):
            p, w = r.plan, r.wrapper
            assert (p.kind, p.window_left, p.sink_logits) == (kind, features.window(i, attn_step.window_left),
                                                               features.layer_sinks(i)), i
            assert (p.logits_soft_cap, p.sm_scale, p.kv_data_type) == (features.soft_cap, attn_step.sm_scale, kv_type)
            assert (p.page_size, p.dtype, w.page_size) == (PAGE, torch.float32, PAGE)
            assert (w.num_qo_heads, w.num_kv_heads, w.head_dim) == (HQ, HKV, D)
            assert r.layer.data_ptr() == kv.layer_view(i).data_ptr(), i
            want = dict(zip(("k_scale", "v_scale"), kv.scales(i), strict=True)) if features.quantized else {}
            if features.layer_sinks(i):
                want["sinks"] = sinks[i]
            assert r.kw.keys() == want.keys() and all(r.kw[k] is want[k] or r.kw[k] == want[k] for k in want), i


@pytest.fixture(autouse=True)
def _empty_records():
    spies.clear()


@pytest.mark.parametrize("features, attn_step", [
    (AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=(0.5, 1.0, 2.0, 4.0), v_scale=(2.0, 1.0, 0.25, 0.5),
                       soft_cap=2.5, sink_logits=SINKS, layer_windows=WINDOWS), AttentionStep(sm_scale=0.3)),
    (AttentionFeatures(soft_cap=2.5, sink_logits=True), AttentionStep(window_left=5, sm_scale=0.3)),
    (AttentionFeatures(sink_logits=SINKS), AttentionStep()),
    (AttentionFeatures(), AttentionStep()),
], ids=["per-layer", "every-layer-sinks-step-window", "per-layer-sinks", "plain"])
def test_each_layer_s_run_reads_a_plan_of_its_own_settings(features, attn_step):
    kv, cfg = _kv(features)
    attn = PagedAttentionManager(kv, "cpu", torch.float32, cfg, spies.SPIES)
    steps, sinks = drive(kv, attn, features, attn_step)
    check_runs(steps, sinks, kv, features, attn_step)
    variants = plan_variants(features, attn_step.window_left)
    for planned, _ in steps:  # one plan per distinct (window, sink need), no more
        assert [(p.window_left, p.sink_logits) for _, p in planned] == list(variants)


def test_layers_of_one_window_and_sink_need_share_a_plan_the_others_do_not():
    features = AttentionFeatures(sink_logits=SINKS, layer_windows=WINDOWS)
    kv, cfg = _kv(features)
    steps, _ = drive(kv, PagedAttentionManager(kv, "cpu", torch.float32, cfg, spies.SPIES), features)
    for _, runs in steps:
        assert runs[0].wrapper is runs[2].wrapper
        assert len({id(r.wrapper) for r in runs}) == 3


@pytest.mark.parametrize("fast, features", [
    (("soft_cap",), AttentionFeatures(soft_cap=2.5, sink_logits=SINKS, layer_windows=WINDOWS)),
    (("soft_cap", "sink_logits", "fp8_e4m3"), AttentionFeatures(
        kv_dtype="fp8_e4m3", k_scale=(0.5, 1.0, 2.0, 4.0), soft_cap=2.5, sink_logits=SINKS, layer_windows=WINDOWS)),
], ids=["sinks-on-reference", "all-on-fastpaged"])
def test_each_group_s_wrappers_get_their_layers_settings_under_either_contract(fake_module, monkeypatch, fast,
                                                                               features):
    """Sink groups on the reference (contract 2.0: the plan object) or on ``fastpaged`` (1.1: loose
    keywords), the others on ``fastpaged``: every layer runs on its group's backend with its own
    settings, and each group's manager plans its group's window and sink need alone."""
    install_group_backend(fake_module, monkeypatch, fast, spied_reference=True)
    kv, cfg = _kv(features)
    attn = build_paged_attention(kv, "cpu", torch.float32, cfg, features=features)
    assert isinstance(attn, GroupedPagedAttentionManager)
    attn_step = AttentionStep(sm_scale=0.3)
    steps, sinks = drive(kv, attn, features, attn_step)
    check_runs(steps, sinks, kv, features, attn_step)
    fast_classes = tuple(WRAPPERS.values())
    for planned, runs in steps:
        for i, r in enumerate(runs):
            m = attn.manager_for(i)
            assert any(r.wrapper is w for w in m._wrappers.values()), i
            on_fast = "sink_logits" in fast or not features.layer_sinks(i)
            assert m.backend_name == (FAKE if on_fast else "reference")
            assert isinstance(r.wrapper, fast_classes) is on_fast, i
        for g, m in zip(attn.groups, attn.managers, strict=True):
            assert m.features == g.features
            mine = [p for w, p in planned if any(w is x for x in m._wrappers.values())]
            assert [(p.window_left, p.sink_logits) for p in mine] == [(g.window, g.sink_logits)], g.describe()
