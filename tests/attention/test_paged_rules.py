"""The paged manager's rules, pinned one by one over managers built by hand on spy wrappers
(tests/plan_spies.py): what it refuses at build, plan and run (naming what is allowed); its
defaults; which wrapper a step's rows go to and what each wrapper is sized for, eagerly and in
graph steps; the slots and numbers of its plans; what it captures per device; the backend it
names on a wrapper's error; what cleanup forgets; and what build_paged_attention asks the
registry."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    AttentionStep,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
    StepContext,
    build_paged_attention,
    select_backend,
)
from mstar_core.attention import paged
from mstar_core.attention.paged import PagedAttnEntry, PagedAttnPlan, full_past_capacity
from mstar_core.errors import InputError, StateError, UnknownName

from .. import plan_spies as spies

LAYERS, HKV, HQ, D, PS, PAGES = 2, 2, 4, 8, 4, 16
PLAIN = AttentionFeatures()
CAUSAL = AttentionStep()
NAMES = {"paged_prefill": "pre", "paged_decode": "dec", "mixed": "mix"}


def _kv(features=PLAIN):
    return KVManager(KVConfig(LAYERS, HKV, D, PS, PAGES, HQ), "cpu", torch.float32, features=features)


def _attn(kv, device="cpu", wrappers=spies.SPIES, **kw):
    return PagedAttentionManager(kv, device, torch.float32, kv.config, wrappers, **kw)


def _node(features=PLAIN, **kw):
    kv = _kv(features)
    attn = _attn(kv, **kw)
    node = Node([kv, attn])
    for r in "abcd":
        node.ingest_request(r)
    return kv, attn, node


def _plan(node, *spans, attn_step=CAUSAL, **ctx):
    """Admit and plan a step of ``(rid, label, n)`` spans (left in flight); its context."""
    st = Step(KVStep(tuple(KVSpan(*s) for s in spans)), attn_step)
    c = StepContext(**ctx)
    assert node.admit(st, c)
    node.plan(st, c)
    return c


def _prompts(node, *spans):
    """Commit ``(rid, n)`` prompts of label "t" (their K/V content does not matter here)."""
    assert node.step(Step(KVStep(tuple(KVSpan(r, "t", n) for r, n in spans))), lambda ctx: None).outcome


def _graph_ready(kv, attn, max_bs=4):
    """Graph buffers for buckets up to ``max_bs``; the spies' records start here."""
    kv.build_accelerator_graph_buffers(2, max_bs, 64)
    attn.build_accelerator_graph_buffers(2, max_bs, 64)
    spies.clear()


def _q(n):
    return torch.randn(n, HQ, D)


def _sizes(kind):
    return [s for k, s in spies.SIZES if k == kind]


@pytest.fixture(autouse=True)
def _empty_records():
    spies.clear()


# -- what it refuses at build -----------------------------------------------------------------------


def test_a_manager_without_wrappers_or_a_selection_is_refused():
    with pytest.raises(InputError, match=r"PagedAttentionManager needs a selection or wrappers \(capability -> "
                                         r"wrapper class\)"):
        PagedAttentionManager(_kv(), "cpu", torch.float32, _kv().config)


def test_multi_token_rows_on_another_wrapper_than_decode_or_prefill_are_refused():
    with pytest.raises(InputError, match=r"multi_token_wrapper must be 'paged_decode' or 'paged_prefill' \(the "
                                         r"selection's\), got 'mixed'"):
        _attn(_kv(), multi_token_wrapper="mixed")


def test_features_asking_for_another_kv_dtype_than_the_cache_stores_are_refused():
    with pytest.raises(InputError, match=r"features ask for kv_dtype 'fp8_e4m3' but the KV cache stores 'auto'"):
        _attn(_kv(), features=AttentionFeatures(kv_dtype="fp8_e4m3"))


def test_features_of_another_layer_count_than_the_cache_are_refused():
    # the KV manager's own features are fine: only the manager's are checked here
    with pytest.raises(InputError, match=r"features.layer_windows has 3 entries, the model 2 layers"):
        _attn(_kv(), features=AttentionFeatures(layer_windows=(2, -1, 2)))


# -- its defaults and what it is made of --------------------------------------------------------------


def test_the_defaults_two_slots_no_graphs_and_the_mixed_wrapper_s_bounds():
    kv, attn, node = _node()
    assert (attn.slots, attn.accelerator_graph, attn.multi_token_wrapper) == (2, False, "paged_prefill")
    _prompts(node, ("a", 3))
    _plan(node, ("a", "t", 1), ("b", "t", 5))
    (size,) = _sizes("mixed")
    assert (size.batch_size, size.max_total_tokens, size.max_num_pages, size.max_prefill_rows) == (256, 16384, 16, 8)
    assert size.workspace_bytes == 1024 and not size.accelerator_graph


@pytest.mark.parametrize("device, given, want", [
    ("cpu", None, 1024),  # the reference needs none
    ("cuda", None, 134217728),  # FlashInfer's recommended 128 MiB per wrapper
    ("cpu", 4096, 4096),
    ("cuda", 4096, 4096),
])
def test_the_workspace_per_wrapper_is_the_one_given_or_the_device_s_default(device, given, want):
    attn = _attn(_kv(), device, workspace_bytes=given)  # built on any machine: nothing is allocated yet
    assert attn.workspace_bytes == want


def test_describe_names_the_one_backend_or_each_capability_s():
    assert _attn(_kv(), backend_name="solo").describe() == "solo"
    assert _attn(_kv(), backend_name="x", backend_names={**NAMES, "mixed": "pre"}).describe() == \
        "paged_prefill: pre, paged_decode: dec, mixed: pre"


@pytest.mark.parametrize("tokens, on, named", [
    (2, "paged_decode", True), (2, "paged_prefill", False), (1, "paged_decode", False)])
def test_the_fingerprint_names_the_decode_wrapper_only_where_it_runs_multi_token_rows(tokens, on, named):
    f = AttentionFeatures(decode_query_tokens=tokens)
    assert _attn(_kv(f), multi_token_wrapper=on).fingerprint().endswith(b":multi_token_on:paged_decode") is named


@pytest.mark.parametrize("given, want", [("paged_decode", "paged_decode"), (None, "paged_prefill")])
def test_a_selection_says_where_multi_token_rows_run(given, want):
    f = AttentionFeatures(decode_query_tokens=2)
    sel = dataclasses.replace(select_backend(device="cpu", dtype=torch.float32, features=f),
                              multi_token_wrapper=given)
    kv = _kv(f)
    attn = PagedAttentionManager(kv, "cpu", torch.float32, kv.config, selection=sel)
    assert attn.multi_token_wrapper == want and attn.backend_names == dict.fromkeys(NAMES, "reference")


def test_a_window_reaching_the_cache_s_capacity_is_full_attention_and_a_shorter_one_kept(caplog):
    cfg = _kv().config  # 16 pages x 4 = 64 tokens
    with caplog.at_level(logging.INFO, logger="mstar_core.attention.paged"):
        assert full_past_capacity(AttentionFeatures(layer_windows=(64, 63)), cfg).layer_windows == (-1, 63)
    assert "layer windows [64] reach past the KV cache (16 pages x 4 = 64 tokens)" in caplog.text
    short = AttentionFeatures(layer_windows=(63, 2))
    assert full_past_capacity(short, cfg) is short  # nothing to change: the features as given


def test_a_plan_compares_and_prints_as_its_entries_whatever_its_kv_plan():
    e = PagedAttnEntry("t", "paged_decode", 2, 1, ((-1, None, ("t", "paged_decode", 0, None, 0)),))
    one, two = PagedAttnPlan((e,), kv_plan="one"), PagedAttnPlan((e,), kv_plan="two")
    assert one == two and "kv_plan" not in repr(one)  # the KV plan's tensors are not the plan's to print


# -- a step's plans: labels, slots and numbers --------------------------------------------------------


def test_a_step_s_entry_is_found_by_label_and_label_none_only_where_it_has_one():
    _, _, node = _node()
    plan = _plan(node, ("a", "text", 3), ("a", "audio", 2)).plan_results["attn"]
    assert plan.entry("audio").num_tokens == 2 and plan.entry("text").num_tokens == 3
    with pytest.raises(InputError, match=r"label=None is ambiguous: this step has labels \['text', 'audio'\]"):
        plan.entry(None)
    with pytest.raises(UnknownName, match=r"label 'video' is not in this step; its labels are \['text', 'audio'\]"):
        plan.entry("video")
    one = _plan(node, ("b", "text", 2)).plan_results["attn"]
    assert one.entry(None) is one.entries[0]


@pytest.mark.parametrize("slots, taken", [(None, [0, 1, 0, 1]), (3, [0, 1, 2, 0])])
def test_eager_steps_take_the_slots_in_turn_and_number_their_plans(slots, taken):
    _, attn, node = _node(**({} if slots is None else {"slots": slots}))
    entries = [_plan(node, (r, "t", 2)).plan_results["attn"].entry("t") for r in "abcd"]
    assert [key[2] for e in entries for _, _, key in e.plans] == taken
    assert [e.serial for e in entries] == [1, 2, 3, 4]
    assert entries[len(set(taken))].wrapper is entries[0].wrapper


def test_a_step_whose_wrapper_a_later_step_re_planned_may_not_run():
    _, attn, node = _node(slots=1)
    first = _plan(node, ("a", "t", 3))
    second = _plan(node, ("b", "t", 3))
    with node.bound(first), pytest.raises(StateError, match=r"the paged_prefill wrapper this step planned \(label "
                                                             r"'t', slot 0\) was re-planned by a later step; at most "
                                                             r"1 steps may be planned ahead"):
        attn.run(_q(3), "t", layer_idx=0)
    with node.bound(second):
        assert attn.run(_q(3), "t", layer_idx=0).shape == (3, HQ, D)


# -- which wrapper a step's rows go to ---------------------------------------------------------------


@pytest.mark.parametrize("on, q_lens, causal, kind, tokens", [
    ("paged_decode", (2, 2), True, "paged_decode", 2),  # uniform rows of decode_query_tokens
    ("paged_prefill", (2, 2), True, "paged_prefill", 1),  # the selection runs them on prefill
    ("paged_decode", (2, 2), False, "paged_prefill", 1),  # a decode wrapper's rows are causal
    ("paged_decode", (2, 3), True, "paged_prefill", 1),  # not uniform
    ("paged_decode", (3, 3), True, "paged_prefill", 1),  # uniform, but not the features' length
])
def test_multi_token_rows_go_to_the_decode_wrapper_only_where_it_runs_them(on, q_lens, causal, kind, tokens):
    _, _, node = _node(AttentionFeatures(decode_query_tokens=2), multi_token_wrapper=on)
    _prompts(node, ("a", 3), ("b", 4))
    spans = [(r, "t", n) for r, n in zip("ab", q_lens, strict=True)]
    assert _plan(node, *spans, attn_step=AttentionStep(causal=causal)).plan_results["attn"].entry("t").kind == kind
    _, plan = spies.PLANS[-1]
    assert (plan.kind, plan.query_tokens) == (kind, tokens)


def test_prefill_and_decode_plans_read_the_layout_s_page_indices_uncopied():
    _, _, node = _node()
    _prompts(node, ("a", 3), ("b", 4))
    for spans in ([("c", "t", 5)], [("a", "t", 1)], [("b", "t", 1), ("d", "t", 2)]):
        (_, lay), = _plan(node, *spans).plan_results["kv"].labels
        _, plan = spies.PLANS[-1]
        if plan.kind == "mixed":  # its split is host arithmetic: the host's copy of the same pages
            assert torch.equal(plan.kv_indices, lay.kv_indices)
        else:  # on a GPU: the indices gathered there, never brought to the host
            assert plan.kv_indices is lay.kv_indices
    assert [p.kind for _, p in spies.PLANS[-3:]] == ["paged_prefill", "paged_decode", "mixed"]


def test_a_decode_plan_is_causal_whatever_the_step_says():
    _, _, node = _node()
    _prompts(node, ("a", 3), ("b", 4))
    _plan(node, ("a", "t", 1), ("b", "t", 1), attn_step=AttentionStep(causal=False))
    _, plan = spies.PLANS[-1]
    assert plan.kind == "paged_decode" and plan.causal is True


# -- graph steps: what is refused, and what each wrapper is built for ----------------------------------


def test_a_graph_step_needs_a_manager_built_for_graphs():
    kv, attn, node = _node()
    _prompts(node, ("a", 3))
    kv.build_accelerator_graph_buffers(2, 4, 64)
    with pytest.raises(StateError, match=r"a graph step needs PagedAttentionManager\(accelerator_graph=True\)"):
        _plan(node, ("a", "t", 1), bucket=1)


def test_a_graph_step_s_bucket_must_be_within_the_graph_buffers():
    kv, attn, node = _node(accelerator_graph=True)
    _prompts(node, ("a", 3))
    kv.build_accelerator_graph_buffers(2, 4, 64)  # the KV manager's, not the attention manager's
    with pytest.raises(InputError, match=r"bucket 1 exceeds build_accelerator_graph_buffers' max_bs 0"):
        _plan(node, ("a", "t", 1), bucket=1)


def test_only_decode_steps_are_graph_steps():
    kv, attn, node = _node(accelerator_graph=True)
    _graph_ready(kv, attn)
    with pytest.raises(InputError, match=r"only decode steps are captured; this step is paged_prefill"):
        _plan(node, ("a", "t", 2), ("b", "t", 2), bucket=4)


@pytest.mark.parametrize("q_lens, t, match", [
    ((3, 3), 3, r"a graph step of 3 query tokens per row; the features allow decode_query_tokens=2"),
    ((2, 1), 2, r"a multi-token decode graph step has 2 query tokens in every row; this one has rows of \[1, 2\]"),
])
def test_a_multi_token_graph_step_must_have_the_runner_s_tokens_in_every_row(q_lens, t, match):
    kv, attn, node = _node(AttentionFeatures(decode_query_tokens=2), accelerator_graph=True)
    _prompts(node, ("a", 3), ("b", 4))
    _graph_ready(kv, attn)
    with pytest.raises(InputError, match=match):
        _plan(node, *((r, "t", n) for r, n in zip("ab", q_lens, strict=True)), bucket=2, query_tokens=t)


def test_a_one_token_graph_step_runs_on_a_decode_wrapper_sized_for_its_bucket():
    kv, attn, node = _node(accelerator_graph=True)
    _prompts(node, ("a", 3), ("b", 4))
    _graph_ready(kv, attn)
    entry = _plan(node, ("a", "t", 1), ("b", "t", 1), bucket=4).plan_results["attn"].entry("t")
    assert (entry.kind, entry.num_tokens) == ("paged_decode", 4)  # padded to the bucket
    (size,) = _sizes("paged_decode")
    assert (size.batch_size, size.max_num_pages, size.accelerator_graph) == (4, PAGES + 4, True)  # a page per pad row
    assert (size.max_total_tokens, size.query_tokens) == (None, 1)


@pytest.mark.parametrize("on, causal", [
    ("paged_prefill", True),
    ("paged_decode", False),  # the decode wrapper runs causal rows alone
])
def test_multi_token_graph_rows_on_the_prefill_wrapper_are_sized_for_the_bucket_s_tokens(on, causal):
    kv, attn, node = _node(AttentionFeatures(decode_query_tokens=2), accelerator_graph=True, multi_token_wrapper=on)
    _prompts(node, ("a", 3), ("b", 4))
    _graph_ready(kv, attn)
    ctx = _plan(node, ("a", "t", 2), ("b", "t", 2), attn_step=AttentionStep(causal=causal), bucket=4, query_tokens=2)
    entry = ctx.plan_results["attn"].entry("t")
    assert (entry.kind, entry.num_tokens) == ("paged_prefill", 8)  # 4 rows of 2, two of them padding
    (size,) = _sizes("paged_prefill")
    assert (size.batch_size, size.max_num_pages, size.max_total_tokens, size.query_tokens) == (4, PAGES + 4, 8, 1)
    with node.bound(ctx):
        assert attn.run(_q(8), "t", layer_idx=0).shape == (8, HQ, D)


@pytest.mark.parametrize("runner_tokens", [2, 3])
def test_multi_token_graph_rows_on_the_decode_wrapper_are_sized_and_planned_for_the_runner_s_rows(runner_tokens):
    f = AttentionFeatures(decode_query_tokens=3)
    kv, attn, node = _node(f, accelerator_graph=True, multi_token_wrapper="paged_decode")
    _prompts(node, ("a", 3), ("b", 4))
    _graph_ready(kv, attn)
    t = runner_tokens
    entry = _plan(node, ("a", "t", t), ("b", "t", t), bucket=2, query_tokens=t).plan_results["attn"].entry("t")
    assert (entry.kind, entry.num_tokens) == ("paged_decode", 2 * t)
    (size,) = _sizes("paged_decode")
    assert type(size.query_tokens) is int and size.query_tokens == t and size.max_total_tokens is None
    (_, plan), = spies.PLANS
    assert plan.query_tokens == t


# -- what it captures, per device ---------------------------------------------------------------------


class _CapturableDecode(spies.SPIES["paged_decode"]):
    graph_capturable = True


@pytest.mark.parametrize("device, graphs, decode, tokens, declared, want", [
    ("cpu", False, spies.SPIES["paged_decode"], 1, None, False),
    ("cpu", True, spies.SPIES["paged_decode"], 1, None, True),  # a CPU re-runs closures: any wrapper
    ("cuda", True, spies.SPIES["paged_decode"], 1, None, False),
    ("cuda", True, _CapturableDecode, 1, None, True),
    ("cuda", True, _CapturableDecode, 2, None, False),  # multi-token rows run on the uncapturable prefill
    ("cuda", True, _CapturableDecode, 1, False, False),  # what the backend declared wins
])
def test_decode_steps_are_captured_on_a_gpu_only_where_every_wrapper_they_run_is_capturable(
        device, graphs, decode, tokens, declared, want):
    kv = _kv(AttentionFeatures(decode_query_tokens=tokens))
    attn = _attn(kv, device, {**spies.SPIES, "paged_decode": decode}, accelerator_graph=graphs,
                 graph_capturable=declared)
    assert attn.can_capture() is want


# -- what a run refuses, and the backend a wrapper's error names ----------------------------------------


def test_a_run_without_a_cache_layer_or_layer_idx_is_refused():
    _, attn, node = _node()
    with node.bound(_plan(node, ("a", "t", 3))), pytest.raises(InputError, match="run needs kv_cache_layer or "
                                                                                "layer_idx"):
        attn.run(_q(3), "t")


def test_a_run_with_q_on_another_device_than_the_cache_is_refused():
    kv, attn, node = _node()
    with node.bound(_plan(node, ("a", "t", 3))), pytest.raises(InputError, match=r"PagedAttentionManager.run: q "
                                                                                r"is on meta, the KV cache on cpu"):
        attn.run(_q(3).to("meta"), "t", kv.layer_view(0), layer_idx=0)  # meta: another device on any machine


def test_run_eager_checks_the_layer_view_unless_told_it_is_a_compiled_graphs():
    kv, attn, node = _node()
    with node.bound(_plan(node, ("a", "t", 3))):
        with pytest.raises(InputError, match=r"kv_cache_layer is layer 1's view \(layer_view\(1\)\), but layer_idx "
                                             r"is 0"):
            attn.run_eager(_q(3), "t", kv.layer_view(1), 0, None)
        assert attn.run_eager(_q(3), "t", kv.layer_view(1), 0, None, check_view=False).shape == (3, HQ, D)


class _Unbuildable(spies.SPIES["paged_prefill"]):
    @classmethod
    def from_size(cls, size):
        raise RuntimeError("no room for it")


class _Failing(spies.SPIES["paged_prefill"]):
    def run(self, q, kv_cache_layer, **kw):
        raise RuntimeError("the kernel failed")


def _notes(info):
    return getattr(info.value, "__notes__", [])


def test_a_wrapper_that_cannot_be_built_is_named_with_its_backend():
    _, _, node = _node(wrappers={**spies.SPIES, "paged_prefill": _Unbuildable}, backend_names=NAMES)
    with pytest.raises(RuntimeError, match="no room for it") as info:
        _plan(node, ("a", "t", 3))
    assert _notes(info) == [f"raised in {__name__}._Unbuildable.__init__ (attention backend 'pre')"]


def test_a_plan_that_fails_is_named_with_the_backend_of_its_kind(monkeypatch):
    _, _, node = _node(backend_names=NAMES)

    def refuse(*args, **kw):
        raise InputError("planted refusal")

    monkeypatch.setattr(paged, "paged_plan", refuse)
    with pytest.raises(InputError, match="planted refusal") as info:
        _plan(node, ("a", "t", 3))
    assert _notes(info) == ["raised in mstar_core.attention.paged.PagedAttentionManager.plan (attention backend "
                            "'pre')"]


def test_a_wrapper_s_failed_run_is_named_with_its_backend():
    kv, attn, node = _node(wrappers={**spies.SPIES, "paged_prefill": _Failing}, backend_names=NAMES)
    with node.bound(_plan(node, ("a", "t", 3))), pytest.raises(RuntimeError, match="the kernel failed") as info:
        attn.run(_q(3), "t", kv.layer_view(0), layer_idx=0)
    assert _notes(info) == [f"raised in {__name__}._Failing.run (attention backend 'pre')"]


# -- cleanup ---------------------------------------------------------------------------------------


def test_cleanup_forgets_the_planned_step_and_its_wrappers():
    _, attn, node = _node(slots=1)
    ctx = _plan(node, ("a", "t", 3))
    built = ctx.plan_results["attn"].entry("t").wrapper
    attn.cleanup()
    with pytest.raises(StateError, match="no step is planned"):
        attn.current  # noqa: B018
    with node.bound(ctx), pytest.raises(StateError, match="re-planned"):
        attn.run(_q(3), "t", layer_idx=0)  # its wrapper's plan is forgotten with it
    assert _plan(node, ("b", "t", 3)).plan_results["attn"].entry("t").wrapper is not built  # one slot: new


# -- build_paged_attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, asked", [(None, D), (16, 16)])
def test_build_paged_attention_selects_for_the_head_dim_given_or_the_kv_layout_s(monkeypatch, head_dim, asked):
    import mstar_core.registry as registry

    seen = []
    real = registry.select_backend

    def select(*args, **kw):
        seen.append(kw["head_dim"])
        return real(*args, **{**kw, "head_dim": D})

    monkeypatch.setattr(registry, "select_backend", select)
    kv = _kv()
    assert isinstance(build_paged_attention(kv, "cpu", torch.float32, kv.config, head_dim=head_dim),
                      PagedAttentionManager)
    assert seen == [asked]


def test_build_paged_attention_refuses_features_of_another_layer_count():
    kv = _kv()
    # checked before the groups are made, naming what the caller called
    with pytest.raises(InputError, match=r"^PagedAttentionManager: features.layer_windows has 3 entries, the model 2 "
                                         r"layers"):
        build_paged_attention(kv, "cpu", torch.float32, kv.config, features=AttentionFeatures(layer_windows=(2, -1, 2)))
