"""The grouped paged manager's rules, pinned one by one over managers built by hand on spy
wrappers (tests/plan_spies.py): every layer in exactly one group of this KV manager; a layer's
calls reach its group's manager alone; a step plans, binds and releases every group; what a
runner asks (capture, pre-planning, staging, graph buffers, validation) is every group's answer;
and the helpers that decide the groups' plans and captures."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    BackendUnavailable,
    GroupedPagedAttentionManager,
    KVConfig,
    KVManager,
    Node,
    PagedAttentionManager,
    StepContext,
    build_paged_attention,
    layer_groups,
)
from mstar_core.attention import grouped, paged
from mstar_core.attention.groups import LayerGroup, same_picks, select_groups
from mstar_core.attention.paged import capture_kinds, decode_capturable, layer_variants, plan_variants
from mstar_core.capabilities import PAGED

from .. import plan_spies as spies
from ..group_fakes import FAKE, install_group_backend
from ..helpers import step

LAYERS, HQ, D = 4, 4, 8
SINKS = (True, False, True, False)  # groups: layers 0,2 (sink logits) and 1,3
FEATURES = AttentionFeatures(sink_logits=SINKS)


def _kv(features=FEATURES, name="kv"):
    cfg = KVConfig(LAYERS, 2, D, 4, 32, HQ)
    return KVManager(cfg, "cpu", torch.float32, features=features, name=name), cfg


def _manager(kv, features, cls=PagedAttentionManager, **kw):
    return cls(kv, "cpu", torch.float32, kv.config, spies.SPIES, features=features, **kw)


def _grouped(kv=None, graphs=(False, False), names=("one", "two"), classes=(PagedAttentionManager,) * 2):
    """The grouped manager of SINKS' two groups, each on its own spy-wrapped manager."""
    kv = _kv()[0] if kv is None else kv
    groups = layer_groups(kv.features, LAYERS)
    return GroupedPagedAttentionManager(kv, [
        (g, _manager(kv, g.features, cls, accelerator_graph=a, backend_name=n))
        for g, a, n, cls in zip(groups, graphs, names, classes, strict=True)])


def _group(layers):
    return LayerGroup(tuple(layers), -1, False, FEATURES)


def _planned(node, *spans):
    st, ctx = step(*spans), StepContext()
    assert node.admit(st, ctx)
    node.plan(st, ctx)
    return ctx


def _q(n):
    return torch.randn(n, HQ, D)


@pytest.fixture(autouse=True)
def _empty_records():
    spies.clear()


# -- every layer in exactly one group ------------------------------------------------------------


def test_a_layer_in_two_groups_is_refused_naming_it():
    kv, _ = _kv()
    m = _manager(kv, kv.features)
    with pytest.raises(ValueError, match=r"layer 1 of layers 1,2,3 \(full\) is in two groups; every layer must be in "
                                         r"exactly one group"):
        GroupedPagedAttentionManager(kv, [(_group((0, 1)), m), (_group((1, 2, 3)), m)])
    with pytest.raises(ValueError, match=r"layer 2 of layers 0,2,2 \(full\) is in two groups"):
        GroupedPagedAttentionManager(kv, [(_group((0, 2, 2)), m), (_group((1, 3)), m)])


@pytest.mark.parametrize("bad", [-1, LAYERS])
def test_a_layer_outside_the_model_is_refused_naming_the_range(bad):
    kv, _ = _kv()
    m = _manager(kv, kv.features)
    with pytest.raises(ValueError, match=rf"layer {bad} of layers .* is not a layer \(0..3\)"):
        GroupedPagedAttentionManager(kv, [(_group((0, 1, 2, 3)), m), (_group((bad,)), m)])


def test_layers_in_no_group_are_refused_naming_them():
    kv, _ = _kv()
    m = _manager(kv, kv.features)
    with pytest.raises(ValueError, match=r"layers \[1, 3\] are in no group; every layer must be in exactly one group"):
        GroupedPagedAttentionManager(kv, [(_group((0, 2)), m)])


def test_a_group_s_manager_over_another_kv_manager_is_refused():
    kv, _ = _kv()
    other, _ = _kv()
    with pytest.raises(ValueError, match=r"the manager of layers 1,3 \(full\) is built over another KV manager"):
        GroupedPagedAttentionManager(kv, [(_group((0, 2)), _manager(kv, kv.features)),
                                          (_group((1, 3)), _manager(other, other.features))])


# -- what it is made of --------------------------------------------------------------------------


def test_its_features_names_and_layout_come_from_the_kv_manager_and_its_groups():
    kv, cfg = _kv()
    attn = _grouped(kv, names=("one", "two"))
    assert attn.features is kv.features and [g.layers for g in attn.groups] == [(0, 2), (1, 3)]
    assert (attn.device, attn.dtype, attn.kv_config) == (torch.device("cpu"), torch.float32, cfg)
    assert attn.backend_name == "one+two" and attn.backend_names == dict.fromkeys(PAGED, "one+two")
    assert _grouped(kv, names=("one", "one")).backend_name == "one"  # each backend named once
    given = AttentionFeatures(sink_logits=SINKS, soft_cap=3.0)
    assert GroupedPagedAttentionManager(kv, list(zip(attn.groups, attn.managers, strict=True)), given).features \
        is given
    assert _grouped(_kv(name="cache")[0]).depends_on() == ("cache",)


def test_the_fingerprint_names_each_group_s_layers_and_its_manager_s_kernels():
    attn = _grouped()
    m0, m1 = attn.managers
    assert attn.fingerprint() == b"attn.grouped:0,2=" + m0.fingerprint() + b"|1,3=" + m1.fingerprint()


# -- a layer's calls go to its group's manager ---------------------------------------------------


def test_each_layer_runs_on_its_own_group_s_manager_through_run_and_run_eager():
    kv, _ = _kv()
    attn = _grouped(kv)
    node = Node([kv, attn])
    node.ingest_request("a")
    ctx = _planned(node, ("a", "text", 3))
    sinks = torch.zeros(HQ)
    with node.bound(ctx):
        for i in range(LAYERS):
            m = attn.managers[0 if SINKS[i] else 1]
            assert attn.manager_for(i) is m
            s = sinks if SINKS[i] else None
            attn.run(_q(3), "text", kv.layer_view(i), layer_idx=i, sinks=s)
            attn.run_eager(_q(3), "text", kv.layer_view(i), i, s)
            for r in spies.RUNS[-2:]:
                assert any(r.wrapper is w for w in m._wrappers.values()) and r.plan.sink_logits is SINKS[i], i
                assert r.layer.data_ptr() == kv.layer_view(i).data_ptr()
    node.rollback_admit(step(("a", "text", 3)), ctx)


@pytest.mark.parametrize("bad, error, match", [
    (None, ValueError, "layer groups take different backends: run needs layer_idx"),
    (LAYERS, IndexError, r"layer_idx 4 out of range: this cache holds layers 0..3"),
    (-1, IndexError, r"layer_idx -1 out of range"),
])
def test_a_run_without_a_layer_of_the_model_is_refused(bad, error, match):
    with pytest.raises(error, match=match):
        _grouped().manager_for(bad)


# -- a step plans, binds and releases every group ------------------------------------------------


def test_planning_a_step_plans_every_group_s_manager():
    kv, _ = _kv()
    attn = _grouped(kv)
    node = Node([kv, attn])
    node.ingest_request("a")
    ctx = _planned(node, ("a", "text", 3))
    plan = ctx.plan_results["attn"]
    assert plan.plans == tuple(m._current for m in attn.managers) and None not in plan.plans
    assert plan.kv_plan is ctx.plan_results["kv"]
    wrappers = []
    for g, m, p in zip(attn.groups, attn.managers, plan.plans, strict=True):
        (w,) = m._wrappers.values()
        assert p.entry("text").wrapper is w and w.kept.sink_logits is g.sink_logits and w.kept.tokens == 3
        wrappers.append(w)
    assert [w for w, _ in spies.PLANS] == wrappers  # one plan per group, in the groups' order


def test_a_bound_step_s_layers_read_its_plan_in_every_group_after_the_next_is_planned():
    kv, _ = _kv()
    attn = _grouped(kv)
    node = Node([kv, attn])
    for r in "ab":
        node.ingest_request(r)
    first = _planned(node, ("a", "text", 3))
    _planned(node, ("b", "text", 5))  # the latest plan of every group is this one
    with node.bound(first):
        for i in range(LAYERS):
            attn.run(_q(3), "text", kv.layer_view(i), layer_idx=i, sinks=torch.zeros(HQ) if SINKS[i] else None)
            assert spies.RUNS[-1].plan.tokens == 3, i
        assert all(m.bound_plan() is p for m, p in zip(attn.managers, first.plan_results["attn"].plans, strict=True))
    assert attn.bound_plan() is None and all(m.bound_plan() is None for m in attn.managers)


# -- what a runner asks is every group's answer --------------------------------------------------


class _Unstaged(PagedAttentionManager):
    force_double_buffer = False  # a manager whose wrappers stage nothing asynchronously


@pytest.mark.parametrize("graphs", [(True, True), (True, False), (False, True), (False, False)])
def test_capture_and_pre_planning_only_where_every_group_can(graphs):
    attn = _grouped(graphs=graphs)
    every = all(graphs)
    assert attn.can_capture() is every and attn.accelerator_graph is every and attn.supports_preplan is every


@pytest.mark.parametrize("classes, staged", [
    ((_Unstaged, _Unstaged), False), ((_Unstaged, PagedAttentionManager), True),
    ((PagedAttentionManager, _Unstaged), True)])
def test_double_buffered_staging_where_any_group_needs_it(classes, staged):
    assert _grouped(classes=classes).force_double_buffer is staged


def test_graph_buffers_and_warm_up_checks_reach_every_group(monkeypatch):
    attn = _grouped(graphs=(True, True))
    attn.build_accelerator_graph_buffers(3, 8, 64)
    assert [(m.slots, m._graph_max_bs) for m in attn.managers] == [(3, 8), (3, 8)]
    checked = []
    for m in attn.managers:
        monkeypatch.setattr(m, "post_warmup_validate", lambda m=m: checked.append(m))
    attn.post_warmup_validate()
    assert checked == list(attn.managers)


# -- the helpers that decide the groups ----------------------------------------------------------


def test_one_plan_per_distinct_window_and_sink_need_in_first_layer_order():
    f = AttentionFeatures(layer_windows=(3, -1, 3, 3), sink_logits=(False, True, True, False))
    assert plan_variants(f, -1) == ((3, False), (-1, True), (3, True))
    assert layer_variants(f) == (0, 1, 2, 0)
    assert plan_variants(AttentionFeatures(sink_logits=True), 5) == ((5, True),)  # no per-layer values
    assert layer_variants(AttentionFeatures(sink_logits=True)) is None


@pytest.mark.parametrize("tokens, on, kinds", [
    (1, "paged_prefill", ("paged_decode",)),
    (3, "paged_prefill", ("paged_decode", "paged_prefill")),
    (3, "paged_decode", ("paged_decode",)),
])
def test_a_decode_step_is_captured_only_where_every_wrapper_it_runs_is_capturable(tokens, on, kinds):
    f = AttentionFeatures(decode_query_tokens=tokens)
    assert capture_kinds(f, on) == kinds
    assert decode_capturable(kinds, f, on)
    assert not decode_capturable(kinds[:-1], f, on)


def test_selections_are_the_same_picks_only_with_the_same_backends_and_multi_token_wrapper():
    a = SimpleNamespace(names={"paged_decode": "x"}, multi_token_wrapper="paged_decode")
    assert same_picks(a, SimpleNamespace(**vars(a)))
    assert not same_picks(a, SimpleNamespace(names={"paged_decode": "y"}, multi_token_wrapper="paged_decode"))
    assert not same_picks(a, SimpleNamespace(names={"paged_decode": "x"}, multi_token_wrapper="paged_prefill"))


def test_a_group_no_backend_serves_is_named(fake_module, monkeypatch):
    install_group_backend(fake_module, monkeypatch)
    kv, cfg = _kv()
    with pytest.raises(BackendUnavailable, match=r"^layers 0,2 \(full, sink logits\): .*sink_logits"):
        build_paged_attention(kv, "cpu", torch.float32, cfg, FAKE)


def test_the_old_import_path_still_works_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"grouped.build_paged_attention moved to "
                                                r"mstar_core.attention.paged.build_paged_attention"):
        assert grouped.build_paged_attention is paged.build_paged_attention
    with warnings.catch_warnings(), pytest.raises(AttributeError, match="no attribute 'nope'"):
        warnings.simplefilter("error")
        grouped.nope  # noqa: B018


# -- what is left after a step, and what a fingerprint holds without a kernel's --------------------


def test_run_eager_checks_the_layer_view_unless_told_it_is_a_compiled_graphs():
    kv, _ = _kv()
    attn = _grouped(kv)
    node = Node([kv, attn])
    node.ingest_request("a")
    ctx = _planned(node, ("a", "text", 3))
    with node.bound(ctx):
        with pytest.raises(Exception, match="layer"):
            attn.run_eager(_q(3), "text", kv.layer_view(1), 0, torch.zeros(HQ))
        attn.run_eager(_q(3), "text", kv.layer_view(1), 0, torch.zeros(HQ), check_view=False)
    node.rollback_admit(step(("a", "text", 3)), ctx)


def test_cleanup_reaches_every_group_and_forgets_the_step_planned(monkeypatch):
    kv, _ = _kv()
    attn = _grouped(kv)
    node = Node([kv, attn])
    node.ingest_request("a")
    ctx = _planned(node, ("a", "text", 3))
    assert attn._current is not None
    cleaned = []
    for m in attn.managers:
        monkeypatch.setattr(m, "cleanup", lambda m=m: cleaned.append(m))
    attn.cleanup()
    assert cleaned == list(attn.managers) and attn._current is None
    node.rollback_admit(step(("a", "text", 3)), ctx)


def test_a_group_whose_manager_has_no_fingerprint_still_names_its_layers(monkeypatch):
    attn = _grouped()
    m0, m1 = attn.managers
    monkeypatch.setattr(m0, "fingerprint", lambda: None)
    assert attn.fingerprint() == b"attn.grouped:0,2=|1,3=" + m1.fingerprint()


def test_one_group_of_every_layer_is_a_grouped_manager_too():
    kv, _ = _kv(AttentionFeatures())
    (g,) = layer_groups(kv.features, LAYERS)
    attn = GroupedPagedAttentionManager(kv, [(g, _manager(kv, g.features))])
    assert attn.managers[0].device == attn.device and attn.kv_config is kv.config


def _selecting(monkeypatch, whole_ok=True):
    """select_backend recording the features it is asked for; the whole model's refused unless
    ``whole_ok`` (it is asked first, with the features of no group)."""
    import mstar_core.registry as registry

    asked = []

    def select(capabilities, features, **kw):
        asked.append(features)
        if not whole_ok and len(asked) == 1:
            raise BackendUnavailable("no backend serves every layer", requested="auto")
        return SimpleNamespace(names={c: "x" for c in capabilities}, multi_token_wrapper=None, summary="x",
                               rejected={})

    monkeypatch.setattr(registry, "select_backend", select)
    return asked


def test_the_whole_model_is_selected_with_its_own_features_or_the_groups_when_none_given(monkeypatch):
    asked = _selecting(monkeypatch)
    whole = AttentionFeatures(sink_logits=SINKS, soft_cap=5.0)
    sel = select_groups(FEATURES, LAYERS, whole_features=whole)
    assert asked[0] is whole and not sel.split
    asked.clear()
    sel = select_groups(FEATURES, LAYERS)
    assert asked[0] is FEATURES and not sel.split


def test_groups_served_only_apart_are_a_split_selection(monkeypatch):
    _selecting(monkeypatch, whole_ok=False)
    sel = select_groups(FEATURES, LAYERS)
    assert sel.split and sel.whole is None and [g.layers for g, _ in sel.groups] == [(0, 2), (1, 3)]
