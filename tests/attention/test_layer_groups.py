"""Layer groups: a group per window and per sink need, each selected apart; one manager where
one selection serves every layer, else one per group under GroupedPagedAttentionManager, whose
outputs are the single reference manager's (eager and through the CPU graph runner)."""

from __future__ import annotations

import logging

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    BuildInfo,
    GroupedPagedAttentionManager,
    KVConfig,
    KVManager,
    Node,
    PagedAttentionManager,
    StepContext,
    build_paged_attention,
    layer_groups,
)
from mstar_core.demo import TinyDecoder, TinyDecoderConfig
from mstar_core.graphs import GraphRunner

from ..group_fakes import FAKE, RUNS, install_group_backend
from ..helpers import step

LAYERS = 4
SINKS = (True, False, True, False)


@pytest.fixture
def fake(fake_module, monkeypatch):
    install_group_backend(fake_module, monkeypatch)


def _kv(features):
    cfg = KVConfig(LAYERS, 2, 8, 4, 32, 4)
    return KVManager(cfg, "cpu", torch.float64, features=features), cfg


def _build(features, backend=None, **kw):
    kv, cfg = _kv(features)
    return kv, build_paged_attention(kv, "cpu", torch.float64, cfg, backend, features=features, **kw)


# -- the groups ----------------------------------------------------------------------------------


def test_a_group_per_window_and_per_sink_need_each_with_uniform_features():
    f = AttentionFeatures(layer_windows=(8, -1, 8, -1), sink_logits=(True, True, False, False), soft_cap=5.0)
    groups = layer_groups(f, LAYERS)
    assert [(g.layers, g.window, g.sink_logits) for g in groups] == [
        ((0,), 8, True), ((1,), -1, True), ((2,), 8, False), ((3,), -1, False)]
    for g in groups:
        g.features.check_layers(LAYERS, "test")  # still one entry per layer
        assert g.features.layer_windows == (g.window,) * LAYERS and g.features.sink_logits is g.sink_logits
        assert g.features.soft_cap == 5.0 and "layer_windows" not in g.features.requested()
    assert groups[0].describe() == "layers 0 (window 8, sink logits)" and groups[3].describe() == "layers 3 (full)"


def test_without_per_layer_windows_groups_split_on_sink_logits_alone():
    groups = layer_groups(AttentionFeatures(sink_logits=SINKS), LAYERS)
    assert [(g.layers, g.window, g.sink_logits, g.features.layer_windows) for g in groups] == [
        ((0, 2), -1, True, None), ((1, 3), -1, False, None)]
    assert len(layer_groups(AttentionFeatures(sink_logits=True), LAYERS)) == 1


# -- which manager -------------------------------------------------------------------------------


def test_one_group_builds_today_s_single_manager(fake):
    _, attn = _build(AttentionFeatures(soft_cap=3.0))
    assert type(attn) is PagedAttentionManager and attn.backend_name == FAKE


def test_equal_picks_for_every_group_build_one_manager_that_plans_per_sink_need(fake):
    kv, attn = _build(AttentionFeatures(sink_logits=SINKS), backend="reference")
    assert type(attn) is PagedAttentionManager and attn.backend_name == "reference"
    node = Node([kv, attn])
    node.ingest_request("a")
    ctx = StepContext()
    st = step(("a", "text", 3))
    assert node.admit(st, ctx)
    plan = node.plan(st, ctx) or ctx.plan_results["attn"]
    assert len(plan.entry("text").plans) == 2  # with sinks and without: one plan each


def test_a_group_only_the_reference_serves_keeps_the_others_on_another_backend(fake, caplog):
    with caplog.at_level(logging.INFO, logger="mstar.registry"):
        _, attn = _build(AttentionFeatures(sink_logits=SINKS))
    assert isinstance(attn, GroupedPagedAttentionManager)
    assert [attn.manager_for(i).backend_name for i in range(LAYERS)] == ["reference", FAKE, "reference", FAKE]
    assert attn.backend_name == f"reference+{FAKE}"
    assert attn.describe() == f"layers 0,2 (full, sink logits): reference; layers 1,3 (full): {FAKE}"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert (f"layer groups: layers 0,2 (full, sink logits) -> reference ({FAKE}: does not support feature "
            "sink_logits") in said
    assert f"layers 1,3 (full) -> {FAKE} (first choice)" in said


def test_a_backend_without_mixed_windows_serves_each_window_group(fake):
    _, attn = _build(AttentionFeatures(layer_windows=(3, -1, 3, -1)))
    assert isinstance(attn, GroupedPagedAttentionManager)  # the whole model would be the reference's
    assert [g.window for g in attn.groups] == [3, -1] and attn.backend_name == FAKE


def test_paged_manager_build_goes_through_the_groups(fake):
    kv, _ = _kv(AttentionFeatures(sink_logits=SINKS))
    info = BuildInfo(torch.device("cpu"), torch.float64, num_layers=LAYERS, num_qo_heads=4, num_kv_heads=2,
                     head_dim=8, built={"kv": kv})
    attn = PagedAttentionManager.build({}, info)
    assert isinstance(attn, GroupedPagedAttentionManager) and attn.depends_on() == ("kv",)


# -- the same outputs ----------------------------------------------------------------------------


def _drive(features, backend):
    """Prefill two requests, then three decode steps; every layer's attention output per step."""
    kv, attn = _build(features, backend)
    node = Node([kv, attn])
    g = torch.Generator().manual_seed(7)
    sinks = [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(LAYERS)]
    outs = []
    for r in ("a", "b"):
        node.ingest_request(r)
    steps = [step(("a", "text", 5), ("b", "text", 9))] + [step(("a", "text", 1), ("b", "text", 1))] * 3
    for st in steps:
        n = sum(s.num_tokens for s in st.kv.spans)

        def forward(ctx, n=n):
            for i in range(LAYERS):
                q = torch.randn(n, 4, 8, generator=g, dtype=torch.float64)
                k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
                kv.write_kv(k, v, layer_idx=i, label="text")
                has = features.layer_sinks(i)
                outs.append(attn.run(q, "text", kv.layer_view(i), layer_idx=i, sinks=sinks[i] if has else None))

        assert node.step(st, forward).outcome
    return attn, outs


@pytest.mark.parametrize("features", [AttentionFeatures(sink_logits=SINKS),
                                      AttentionFeatures(sink_logits=SINKS, layer_windows=(2, 2, -1, -1))],
                         ids=["sinks", "sinks-and-windows"])
def test_the_grouped_manager_s_outputs_are_the_single_reference_manager_s(fake, features):
    grouped, got = _drive(features, None)
    single, want = _drive(features, "reference")
    assert isinstance(grouped, GroupedPagedAttentionManager) and type(single) is PagedAttentionManager
    assert RUNS.get("paged_prefill", 0) > 0 and RUNS.get("paged_decode", 0) > 0  # the fake ran its layers
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert grouped.fingerprint() != single.fingerprint()


def _runner(features, backend, graphs=True):
    cfg = TinyDecoderConfig(num_layers=LAYERS, hidden=32, mlp=64, num_qo_heads=4, num_kv_heads=2, head_dim=8)
    model = TinyDecoder(cfg, "cpu", torch.float64, seed=5)
    kv, attn = _build(features, backend, accelerator_graph=graphs)
    node = Node([kv, attn])
    runner = GraphRunner(node, model.step_forward(kv, attn), [1, 2], "cpu")
    runner.warmup()
    return attn, node, runner


def _generate(features, backend):
    attn, node, runner = _runner(features, backend)
    assert runner.enabled and runner.supports_preplan
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2]}
    for r in prompts:
        node.ingest_request(r)
    out = runner.step(step(*((r, "text", len(p)) for r, p in prompts.items())),
                      torch.tensor([t for p in prompts.values() for t in p]))
    ends = torch.tensor([len(p) for p in prompts.values()]).cumsum(0) - 1
    logits, nxt = [out[ends]], out[ends].argmax(-1)
    for _ in range(4):
        prep = runner.prepare(step(*((r, "text", 1) for r in prompts)))
        assert prep.graph is not None  # the graph path
        out = runner.launch(prep, nxt)
        logits.append(out.clone())
        nxt = out.argmax(-1)
    return attn, torch.stack(logits)


def test_through_the_cpu_graph_runner_the_grouped_manager_gives_the_single_one_s_logits(fake):
    features = AttentionFeatures(layer_windows=(3, -1, 3, -1))
    grouped, got = _generate(features, None)
    single, want = _generate(features, "reference")
    assert isinstance(grouped, GroupedPagedAttentionManager) and grouped.can_capture()
    assert grouped.force_double_buffer and type(single) is PagedAttentionManager
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_cleanup_reaches_every_group(fake):
    _, attn = _build(AttentionFeatures(sink_logits=SINKS))
    assert isinstance(attn, GroupedPagedAttentionManager)
    attn.cleanup()
    assert all(m._current is None and not m._wrappers for m in attn.managers)


# -- bad inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, match", [
    ((True, 1), r"sink_logits\[1\] must be a bool .*got int 1"),
    ([], r"sink_logits must be a bool \(every layer\), or a sequence .* one bool per layer; got an empty list"),
    ("yes", r"sink_logits must be a bool \(every layer\), or a sequence"),
    (1, r"sink_logits must be a bool \(every layer\), or a sequence"),
    ({0: True}, r"sink_logits must be a bool"),
])
def test_per_layer_sink_logits_that_are_not_bools_are_refused_naming_what_is_allowed(value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        AttentionFeatures(sink_logits=value)


def test_a_per_layer_sink_list_of_the_wrong_length_is_refused_naming_the_counts(fake):
    f = AttentionFeatures(sink_logits=(True, False))
    with pytest.raises(ValueError, match=r"features.sink_logits has 2 entries, the model 4 layers; give one per layer "
                                         r"\(or one bool for all\)"):
        _build(f)
    with pytest.raises(ValueError, match="sink_logits has 2 entries"):
        layer_groups(f, LAYERS)


def test_a_layer_without_sinks_refuses_them_and_one_with_them_requires_them(fake):
    f = AttentionFeatures(sink_logits=SINKS)
    assert f.requested() == ("sink_logits",) and str(f) == "sink_logits on layers [0, 2]"
    s = torch.zeros(4, dtype=torch.float64)
    f.check_sinks(s, 4, torch.device("cpu"), "t", 0)
    f.check_sinks(None, 4, torch.device("cpu"), "t", 1)
    with pytest.raises(ValueError, match=r"sinks given, but layer 1 has no sink logits \(sink_logits\[1\]=False\)"):
        f.check_sinks(s, 4, torch.device("cpu"), "t", 1)
    with pytest.raises(ValueError, match=r"sinks not given, but layer 2 has sink logits"):
        f.check_sinks(None, 4, torch.device("cpu"), "t", 2)
    with pytest.raises(ValueError, match="run needs layer_idx"):
        f.check_sinks(None, 4, torch.device("cpu"), "t")
    assert not AttentionFeatures(sink_logits=(False,) * LAYERS).requested()


def test_the_grouped_manager_needs_layer_idx(fake):
    kv, attn = _build(AttentionFeatures(sink_logits=SINKS))
    with pytest.raises(ValueError, match="layer groups take different backends: run needs layer_idx"):
        attn.run(torch.zeros(1, 4, 8, dtype=torch.float64), "text", kv.layer_view(0))
    with pytest.raises(ValueError, match="every layer must be in exactly one group"):
        GroupedPagedAttentionManager(kv, [(attn.groups[0], attn.managers[0])])
