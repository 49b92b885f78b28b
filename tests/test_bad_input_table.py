"""Bad inputs at the public API, one table: every case must raise the expected error type, with a
message that names the bad value, and leave every manager exactly as it was (pages, streams,
slots, lengths, in-flight marks, stored K/V, planned wrappers, pending graph steps).

The world holds a paged KV manager + paged attention under a GraphRunner (graphs on, one step
prepared and pending) and a bounded KV manager with a committed request; snapshots compare all
of their state before and after each case. The other surfaces' own tables (FlashInfer index
arrays, varlen ``cu`` arrays, the CLI, the transformers engine) are in
tests/plugins/flashinfer/test_bad_inputs.py, tests/backends/test_varlen_bad_inputs.py,
tests/cli/test_cli_bad_inputs.py and tests/integrations/transformers/test_generate_inputs.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    AttentionStep,
    BoundedKVConfig,
    BoundedKVManager,
    BoundedStep,
    DenseAttentionManager,
    GraphRunner,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
    StepContext,
    StreamPosition,
    select_backend,
)
from mstar_core.backends.reference import ReferencePrefixedPrefillWrapper
from mstar_core.warmup import WarmupConfig

from .helpers import REF_WRAPPERS, bstep

F64 = torch.float64
HQ, HKV, D = 4, 2, 8


@dataclass
class World:
    kv: KVManager
    attn: PagedAttentionManager
    node: Node
    runner: GraphRunner
    pending: Any
    bounded: BoundedKVManager
    bnode: Node


def make_world() -> World:
    cfg = KVConfig(2, HKV, D, 4, 32, HQ)
    kv = KVManager(cfg, "cpu", F64)
    attn = PagedAttentionManager(kv, "cpu", F64, cfg, REF_WRAPPERS, accelerator_graph=True)
    node = Node([kv, attn])

    def forward(ctx, tokens):
        n = tokens.numel()
        x = tokens.to(F64)[:, None, None].expand(n, HKV, D).contiguous()
        kv.write_kv(x, x, layer_idx=0, label="text")
        return attn.run(x.repeat(1, HQ // HKV, 1), "text", layer_idx=0)[:, 0]

    runner = GraphRunner(node, forward, buckets=[1, 2], device="cpu")
    runner.warmup()
    for r in ("a", "b", "c"):
        node.ingest_request(r)
    runner.launch(runner.prepare(Step(KVStep((KVSpan("a", "text", 5), KVSpan("b", "text", 3))))), torch.arange(8))
    pending = runner.prepare(Step(KVStep((KVSpan("a", "text", 1),))))  # planned, not launched

    bcfg = BoundedKVConfig(num_layers=2, max_slots=2, rows=1, num_heads=HKV, head_dim=D, sink=1, window=4)
    bounded = BoundedKVManager(bcfg, "cpu", F64)
    bnode = Node([bounded])
    bounded.ingest_request("x")
    bstep = Step(KVStep(()), extra=(("bounded", BoundedStep((StreamPosition("x", 3),))),))
    q = torch.ones(1, HKV, 3, D, dtype=F64)
    bnode.step(bstep, lambda ctx: bounded.attend(0, q, q, q))
    return World(kv, attn, node, runner, pending, bounded, bnode)


def snapshot(w: World) -> tuple:
    kv, b = w.kv, w.bounded
    return (
        sorted(kv.pool.used), kv.pool.num_free, tuple(kv.requests),
        {k: (tuple(s.pages), s.length, s.generation, s.in_flight) for k, s in kv.streams.items()},
        kv.storage.clone(), dict(w.attn._planned), dict(w.runner._pending), list(w.runner._open), w.runner._next_slot,
        w.pending.done, dict(w.pending.ctx.admitted),
        tuple(b._free), dict(b._slot), dict(b._length), dict(b._epoch), dict(b._uncommitted_writes), dict(b._in_flight),
        tuple(b.requests), b.storage.clone(),
    )


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


def one(rid: str, n: int = 1, label: str = "text") -> Step:
    return Step(KVStep((KVSpan(rid, label, n),)))


def q(n: int, heads: int = HQ, dtype=F64, device="cpu") -> torch.Tensor:
    return torch.zeros(n, heads, D, dtype=dtype, device=device)


def kvt(n: int, device="cpu") -> torch.Tensor:
    return torch.zeros(n, HKV, D, dtype=F64, device=device)


def planned_b(w: World) -> StepContext:
    """Setup: a two-token step for ``b`` admitted and planned (so ``attn.run`` has a plan)."""
    ctx = StepContext()
    assert w.node.admit(one("b", 2), ctx)
    w.node.plan(one("b", 2), ctx)
    return ctx


def committed_c(w: World) -> tuple[Step, StepContext]:
    """Setup: a step that ran and committed, with its spent context."""
    step = one("c", 2)
    return step, w.node.step(step, lambda ctx: None).ctx


def admitted_c(w: World) -> StepContext:
    ctx = StepContext()
    assert w.node.admit(one("c"), ctx)
    return ctx


def rolled_back_b(w: World) -> None:
    """Setup: a step for ``b`` admitted, planned, then rolled back (its plan is dead)."""
    ctx = planned_b(w)
    w.node.rollback_admit(one("b", 2), ctx)


def rolled_back_x(w: World) -> Any:
    """Setup: a bounded step for ``x`` admitted, planned, then rolled back; returns its dead plan."""
    s, ctx = bstep(StreamPosition("x", 1)), StepContext()
    assert w.bnode.admit(s, ctx)
    w.bnode.plan(s, ctx)
    plan = ctx.plan_results[w.bounded.name]
    w.bnode.rollback_admit(s, ctx)
    return plan


def committed_x_then_admitted(w: World) -> Any:
    """Setup: a bounded step for ``x`` that ran and committed, then ``x``'s next step admitted
    (same request, same epoch); returns the committed step's dead plan."""
    s = bstep(StreamPosition("x", 1))
    plan = w.bnode.step(s, lambda ctx: w.bounded.attend(0, ONE, ONE, ONE)).ctx.plan_results[w.bounded.name]
    assert w.bounded.admit(bstep(StreamPosition("x", 1)), StepContext())
    return plan


def admitted_x(w: World) -> StepContext:
    ctx = StepContext()
    assert w.bounded.admit(bstep(StreamPosition("x", 1)), ctx)
    return ctx


def planned_x(w: World) -> Any:
    """Setup: a one-token bounded step for ``x`` admitted and planned; returns its plan."""
    s, ctx = bstep(StreamPosition("x", 1)), StepContext()
    assert w.bnode.admit(s, ctx)
    w.bnode.plan(s, ctx)
    return ctx.plan_results[w.bounded.name]


ONE = torch.ones(1, HKV, 1, D, dtype=F64)


def _bound_write(w: World, ctx: StepContext) -> None:
    """A write inside the binding of a step that has already committed."""
    with w.node.bound(ctx):
        w.kv.write_kv(kvt(2), kvt(2), layer_idx=0, label="text")


# (id, call(world, state), error type, a regex the message must match (the bad value)[, setup(world) -> state])
CASES: list[tuple] = [
    # -- step declarations ------------------------------------------------------------------
    ("span-float-tokens", lambda w, st: KVSpan("a", "text", 2.0), TypeError, r"got 2\.0 \(float\)"),
    ("span-str-tokens", lambda w, st: KVSpan("a", "text", "3"), TypeError, r"got '3' \(str\)"),
    ("span-none-tokens", lambda w, st: KVSpan("a", "text", None), TypeError, r"got None"),
    ("span-tensor-tokens", lambda w, st: KVSpan("a", "text", torch.tensor(3)), TypeError, r"tensor\(3\) \(Tensor\)"),
    ("span-bool-tokens", lambda w, st: KVSpan("a", "text", True), TypeError, r"got True \(bool\)"),
    ("span-negative-tokens", lambda w, st: KVSpan("a", "text", -1), ValueError, r"got -1"),
    ("span-int-request", lambda w, st: KVSpan(5, "text", 1), TypeError, r"request_id must be a str, got 5"),
    ("span-none-label", lambda w, st: KVSpan("a", None, 1), TypeError, r"label must be a str, got None"),
    ("span-str-commit", lambda w, st: KVSpan("a", "text", 1, commit="yes"), TypeError,
     r"commit must be a bool, got 'yes'"),
    ("step-not-a-span", lambda w, st: KVStep((("a", "text", 1),)), TypeError, r"\('a', 'text', 1\)"),
    ("step-stream-twice", lambda w, st: KVStep((KVSpan("a", "t", 1), KVSpan("a", "t", 2))), ValueError,
     r"\('a', 't'\)"),
    ("window-minus-5", lambda w, st: AttentionStep(window_left=-5), ValueError, r"got -5"),
    ("window-float", lambda w, st: AttentionStep(window_left=2.5), ValueError, r"got 2\.5"),
    ("window-bool", lambda w, st: AttentionStep(window_left=True), ValueError, r"got True"),
    ("scale-nan", lambda w, st: AttentionStep(sm_scale=math.nan), ValueError, r"got nan"),
    ("scale-inf", lambda w, st: AttentionStep(sm_scale=math.inf), ValueError, r"got inf"),
    ("scale-zero", lambda w, st: AttentionStep(sm_scale=0.0), ValueError, r"got 0\.0"),
    ("scale-negative", lambda w, st: AttentionStep(sm_scale=-0.5), ValueError, r"got -0\.5"),
    ("scale-str", lambda w, st: AttentionStep(sm_scale="0.1"), ValueError, r"got '0\.1'"),
    ("causal-str", lambda w, st: AttentionStep(causal="no"), TypeError, r"got 'no'"),
    ("position-float-tokens", lambda w, st: StreamPosition("x", 1.5), TypeError, r"1\.5"),
    ("position-negative-start", lambda w, st: StreamPosition("x", 1, start=-2), ValueError, r"-2"),
    ("position-source-minus-2", lambda w, st: StreamPosition("x", 1, source=-2), ValueError, r"-2"),
    ("bounded-step-twice", lambda w, st: BoundedStep((StreamPosition("x", 1), StreamPosition("x", 2))), ValueError,
     r"\['x', 'x'\]"),
    # -- paged KV manager ---------------------------------------------------------------------
    ("admit-unknown-request", lambda w, st: w.node.step(one("zz"), lambda ctx: None), KeyError, r"'zz'"),
    ("admit-stream-in-flight", lambda w, st: w.node.step(one("a"), lambda ctx: None), RuntimeError, r"\('a', 'text'\)"),
    ("admit-twice-into-a-context", lambda w, st: w.kv.admit(one("b"), st), RuntimeError,
     r"already holds an admitted step", admitted_c),
    ("plan-without-admit", lambda w, st: w.kv.plan(one("b"), StepContext()), RuntimeError, r"\('b', 'text'\)"),
    ("commit-without-admit", lambda w, st: w.kv.commit(one("b"), StepContext()), RuntimeError, r"\('b', 'text'\)"),
    ("commit-twice", lambda w, st: w.kv.commit(*st), RuntimeError, r"\('c', 'text'\)", committed_c),
    ("commit-admitted-never-planned", lambda w, st: w.kv.commit(one("c"), st), RuntimeError,
     r"\('c', 'text'\)\].*never planned", admitted_c),
    ("write-after-rollback", lambda w, st: w.kv.write_kv(kvt(2), kvt(2), layer_idx=0, label="text"), RuntimeError,
     r"no step is planned", rolled_back_b),
    ("run-after-rollback", lambda w, st: w.attn.run(q(2), "text", layer_idx=0), RuntimeError, r"no step is planned",
     rolled_back_b),
    ("write-after-commit", lambda w, st: w.kv.write_kv(kvt(2), kvt(2), layer_idx=0, label="text"), RuntimeError,
     r"no step is planned", committed_c),
    ("write-bound-to-a-landed-step", lambda w, st: _bound_write(w, st[1]), RuntimeError, r"no step is planned",
     committed_c),
    ("write-layer-minus-1", lambda w, st: w.kv.write_kv(kvt(1), kvt(1), layer_idx=-1, label="text"), IndexError,
     r"layer_idx -1 out of range"),
    ("write-layer-2", lambda w, st: w.kv.write_kv(kvt(1), kvt(1), layer_idx=2, label="text"), IndexError,
     r"layer_idx 2 out of range"),
    ("write-layer-str", lambda w, st: w.kv.write_kv(kvt(1), kvt(1), layer_idx="0", label="text"), IndexError,
     r"layer_idx '0' out of range"),
    ("write-other-device", lambda w, st: w.kv.write_kv(kvt(1, "meta"), kvt(1, "meta"), layer_idx=0, label="text"),
     ValueError, r"on meta"),
    ("write-unknown-label", lambda w, st: w.kv.write_kv(kvt(1), kvt(1), layer_idx=0, label="audio"), KeyError,
     r"'audio'"),
    ("layer-view-minus-1", lambda w, st: w.kv.layer_view(-1), IndexError, r"-1"),
    ("fork-unknown-source", lambda w, st: w.kv.fork("zz", "c", "text"), KeyError, r"'zz'"),
    ("fork-into-uningested", lambda w, st: w.kv.fork("b", "zz", "text"), KeyError, r"'zz'"),
    ("fork-into-existing", lambda w, st: w.kv.fork("b", "a", "text"), ValueError, r"'a'"),
    ("stream-unknown", lambda w, st: w.kv.stream("b", "audio"), KeyError, r"\('b', 'audio'\)"),
    # -- paged attention ----------------------------------------------------------------------
    ("run-q-wrong-shape", lambda w, st: w.attn.run(q(3), "text", layer_idx=0), ValueError, r"\(3, 4, 8\)", planned_b),
    ("run-q-wrong-dtype", lambda w, st: w.attn.run(q(2, dtype=torch.float32), "text", layer_idx=0), TypeError,
     r"torch\.float32", planned_b),
    ("run-q-other-device", lambda w, st: w.attn.run(q(2, device="meta"), "text", w.kv.layer_view(0)), ValueError,
     r"on meta", planned_b),
    ("run-unknown-label", lambda w, st: w.attn.run(q(2), "audio", layer_idx=0), KeyError, r"'audio'", planned_b),
    ("run-layer-minus-1", lambda w, st: w.attn.run(q(2), "text", layer_idx=-1), IndexError, r"-1", planned_b),
    ("write-wrong-shape", lambda w, st: w.kv.write_kv(kvt(3), kvt(3), layer_idx=0, label="text"), ValueError,
     r"\(3, 2, 8\)", planned_b),
    # -- the graph runner ---------------------------------------------------------------------
    ("launch-wrong-token-count", lambda w, st: w.runner.launch(w.pending, torch.arange(3)), ValueError,
     r"step's 1 tokens, got \(3,\)"),
    ("launch-2d-tokens", lambda w, st: w.runner.launch(w.pending, torch.zeros(1, 1, dtype=torch.long)), ValueError,
     r"got \(1, 1\)"),
    ("launch-a-list", lambda w, st: w.runner.launch(w.pending, [1]), ValueError, r"got list"),
    ("runner-bucket-0", lambda w, st: GraphRunner(w.node, lambda c, t: t, buckets=[0], device="cpu"), ValueError,
     r"\[0\]"),
    ("runner-slots-0", lambda w, st: GraphRunner(w.node, lambda c, t: t, buckets=[1], device="cpu", slots=0),
     ValueError, r"got 0"),
    ("runner-bucket-float", lambda w, st: GraphRunner(w.node, lambda c, t: t, buckets=[2.0], device="cpu"),
     ValueError, r"\[2\.0\]"),
    ("runner-bucket-bool", lambda w, st: GraphRunner(w.node, lambda c, t: t, buckets=[True], device="cpu"),
     ValueError, r"\[True\]"),
    ("runner-buckets-an-int", lambda w, st: GraphRunner(w.node, lambda c, t: t, buckets=3, device="cpu"),
     TypeError, r"int 3"),
    ("runner-query-tokens-past-features",
     lambda w, st: GraphRunner(w.node, lambda c, t: t, buckets=[1], device="cpu", query_tokens=2), ValueError,
     r"query_tokens=2.*\['kv', 'attn'\].*decode_query_tokens=1"),
    ("runner-one-slot-double-buffer",
     lambda w, st: GraphRunner(w.node, lambda c, t: t, buckets=[1], device="cpu", slots=1), ValueError, r"slots=1"),
    # -- bounded KV manager -------------------------------------------------------------------
    ("bounded-admit-unknown", lambda w, st: w.bnode.step(bstep(StreamPosition("zz", 1)), lambda ctx: None), KeyError,
     r"'zz'"),
    ("bounded-wrong-start", lambda w, st: w.bnode.step(bstep(StreamPosition("x", 1, start=1)), lambda ctx: None),
     ValueError, r"start 1"),
    ("bounded-attend-layer-minus-1", lambda w, st: w.bounded.attend(-1, ONE, ONE, ONE, plan=st), IndexError, r"-1",
     planned_x),
    ("bounded-attend-layer-2", lambda w, st: w.bounded.attend(2, ONE, ONE, ONE, plan=st), IndexError, r"\b2\b",
     planned_x),
    ("bounded-q-wrong-rank", lambda w, st: w.bounded.attend(0, ONE[0], ONE, ONE, plan=st), ValueError,
     r"\(2, 1, 8\)", planned_x),
    ("bounded-k-other-device", lambda w, st: w.bounded.attend(0, ONE, ONE.to("meta"), ONE, plan=st), ValueError,
     r"meta", planned_x),
    ("bounded-admit-in-flight", lambda w, st: w.bnode.step(bstep(StreamPosition("x", 1)), lambda ctx: None),
     RuntimeError, r"'x'", planned_x),
    ("bounded-plan-without-admit", lambda w, st: w.bounded.plan(bstep(StreamPosition("x", 1)), StepContext()),
     RuntimeError, r"'x'"),
    ("bounded-attend-after-rollback", lambda w, st: w.bounded.attend(0, ONE, ONE, ONE, plan=st), RuntimeError,
     r"no step is planned.*\['x'\]", rolled_back_x),
    ("bounded-attend-current-after-rollback", lambda w, st: w.bounded.attend(0, ONE, ONE, ONE), RuntimeError,
     r"no step is planned.*\['x'\]", rolled_back_x),
    ("bounded-attend-landed-plan-after-next-admit", lambda w, st: w.bounded.attend(0, ONE, ONE, ONE, plan=st),
     RuntimeError, r"no step is planned.*\['x'\]", committed_x_then_admitted),
    ("bounded-attend-current-after-next-admit", lambda w, st: w.bounded.attend(0, ONE, ONE, ONE), RuntimeError,
     r"no step is planned.*\['x'\]", committed_x_then_admitted),
    ("bounded-commit-admitted-never-planned",
     lambda w, st: w.bounded.commit(bstep(StreamPosition("x", 1)), st), RuntimeError, r"\['x'\].*never planned",
     admitted_x),
    ("bounded-commit-without-admit", lambda w, st: w.bounded.commit(bstep(StreamPosition("x", 1)), StepContext()),
     RuntimeError, r"'x'"),
    # -- selection ----------------------------------------------------------------------------
    ("select-requested-int", lambda w, st: select_backend(("paged_decode",), requested=3, device="cpu"), TypeError,
     r"int 3"),
    ("select-requested-list", lambda w, st: select_backend(("paged_decode",), requested=["x"], device="cpu"), TypeError,
     r"\['x'\]"),
    ("select-unknown-name", lambda w, st: select_backend(("paged_decode",), requested="nope", device="cpu"), ValueError,
     r"'nope'"),
    ("select-config-list", lambda w, st: select_backend(("paged_decode",), config=[1, 2], device="cpu"), ValueError,
     r"list \[1, 2\]"),
]

CASES = [c if len(c) == 5 else (*c, None) for c in CASES]


@pytest.mark.parametrize("name,call,exc,names,setup", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_by_name_and_changes_nothing(name, call, exc, names, setup, monkeypatch):
    monkeypatch.delenv("MSTAR_ATTENTION_BACKEND", raising=False)
    w = make_world()
    state = setup(w) if setup else None  # a case's own setup is not what must stay unchanged
    before = snapshot(w)
    with pytest.raises(exc) as err:
        call(w, state)
    msg = str(err.value.args[0]) if err.value.args else str(err.value)
    assert re.search(names, msg), f"message does not name the bad value ({names!r}): {msg}"
    assert same(before, snapshot(w)), f"{name}: the managers changed"
    # The world still works: the pending step launches and lands.
    out = w.runner.launch(w.pending, torch.tensor([7]))
    assert torch.isfinite(out).all() and w.kv.stream("a", "text").length == 6


def test_the_table_covers_every_boundary():
    """Counts reported in the closing note; a shrinking table would hide a lost case."""
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)


# -- attention features: a second world whose managers ask for FP8 KV, sink logits and per-layer
# windows (the paged and the dense manager, each over its own cache), one step planned in each ---

FEATURES = AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=(0.5, 2.0), v_scale=0.25, sink_logits=True,
                             layer_windows=(2, -1))
SINKS = torch.zeros(HQ, dtype=F64)


@dataclass
class FeatureWorld:
    kv: KVManager
    attn: PagedAttentionManager
    dkv: KVManager
    dense: DenseAttentionManager
    mkv: KVManager  # multi-token decode, two query tokens per row, under graphs
    mnode: Node


def make_feature_world() -> FeatureWorld:
    cfg = KVConfig(2, HKV, D, 4, 32, HQ)
    kv, dkv = KVManager(cfg, "cpu", F64, features=FEATURES), KVManager(cfg, "cpu", F64, features=FEATURES)
    attn = PagedAttentionManager(kv, "cpu", F64, cfg, REF_WRAPPERS)
    dense = DenseAttentionManager(dkv, "cpu", F64, cfg, ReferencePrefixedPrefillWrapper)
    for mgr, span in ((kv, KVSpan("a", "text", 3)), (dkv, KVSpan("a", "text", 3, commit=False))):
        node = Node([mgr, attn if mgr is kv else dense])
        node.ingest_request("a")
        step, ctx = Step(KVStep((span,))), StepContext()
        assert node.admit(step, ctx)
        node.plan(step, ctx)
    mkv = KVManager(cfg, "cpu", F64, features=AttentionFeatures(decode_query_tokens=2))
    mnode = Node([mkv, PagedAttentionManager(mkv, "cpu", F64, cfg, REF_WRAPPERS, accelerator_graph=True)])
    return FeatureWorld(kv, attn, dkv, dense, mkv, mnode)


def feature_snapshot(f: FeatureWorld) -> tuple:
    return tuple(x for kv in (f.kv, f.dkv) for x in (
        sorted(kv.pool.used), kv.storage.clone(),
        {k: (tuple(s.pages), s.length, s.in_flight) for k, s in kv.streams.items()},
    )) + (dict(f.attn._planned), f.dense.cached_prefix_tokens, f.mkv.num_free_pages, f.mkv.sink_page)


def kvq(n: int) -> torch.Tensor:
    return torch.ones(n, HKV, D, dtype=F64)


# (id, call(feature world), error type, a regex the message must match (the bad value))
FEATURE_CASES: list[tuple] = [
    # -- what AttentionFeatures accepts -----------------------------------------------------
    ("k-scale-without-fp8", lambda f: AttentionFeatures(k_scale=2.0), ValueError, r"k_scale=2\.0.*kv_dtype 'auto'"),
    ("v-scales-without-fp8", lambda f: AttentionFeatures(v_scale=(1.0, 0.5)), ValueError,
     r"v_scale=\(1\.0, 0\.5\).*kv_dtype 'auto'"),
    ("k-scale-denormal", lambda f: AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=1e-320), ValueError,
     r"k_scale must be .*float32.*got 1e-320"),
    ("k-scale-below-float32", lambda f: AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=1e-39), ValueError,
     r"k_scale must be .*got 1e-39"),
    ("v-scale-past-float32", lambda f: AttentionFeatures(kv_dtype="fp8_e5m2", v_scale=(1.0, 1e39)), ValueError,
     r"v_scale\[1\] must be .*got 1e\+39"),
    ("k-scale-bool", lambda f: AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=True), ValueError, r"got True"),
    ("soft-cap-denormal", lambda f: AttentionFeatures(soft_cap=5e-324), ValueError, r"soft_cap must be .*got 5e-324"),
    ("sm-scale-denormal", lambda f: AttentionStep(sm_scale=1e-310), ValueError, r"sm_scale must be .*got 1e-310"),
    ("layer-windows-mapping", lambda f: AttentionFeatures(layer_windows={1: 2}), TypeError,
     r"layer_windows must be a sequence .*per layer.*got dict \{1: 2\}"),
    ("layer-windows-int", lambda f: AttentionFeatures(layer_windows=5), TypeError,
     r"layer_windows must be a sequence .*got int 5"),
    ("layer-windows-set", lambda f: AttentionFeatures(layer_windows={4, -1}), TypeError, r"got set"),
    ("layer-windows-str", lambda f: AttentionFeatures(layer_windows="12"), TypeError, r"got str '12'"),
    ("layer-windows-bool", lambda f: AttentionFeatures(layer_windows=(2, False)), ValueError,
     r"layer_windows\[1\] .*got False"),
    ("layer-windows-float", lambda f: AttentionFeatures(layer_windows=(2.0,)), ValueError,
     r"layer_windows\[0\] .*got 2\.0"),
    ("kv-dtype-list", lambda f: AttentionFeatures(kv_dtype=["fp8_e4m3"]), ValueError, r"kv_dtype \['fp8_e4m3'\]"),
    ("decode-tokens-float", lambda f: AttentionFeatures(decode_query_tokens=2.0), ValueError, r"got 2\.0"),
    ("warmup-windows-int", lambda f: WarmupConfig(windows=5), TypeError, r"windows must be a sequence .*got int 5"),
    ("warmup-windows-mapping", lambda f: WarmupConfig(windows={1: 2}), TypeError, r"got dict \{1: 2\}"),
    # -- a declared feature is supplied; a per-layer input belongs to its layer -------------
    ("paged-sinks-missing", lambda f: f.attn.run(q(3), "text", f.kv.layer_view(0), layer_idx=0), ValueError,
     r"sinks not given.*sink_logits"),
    ("dense-sinks-missing", lambda f: f.dense.run(q(3), "text", k=kvq(3), v=kvq(3), layer_idx=0), ValueError,
     r"sinks not given.*sink_logits"),
    ("paged-view-of-another-layer",
     lambda f: f.attn.run(q(3), "text", f.kv.layer_view(0), layer_idx=1, sinks=SINKS), ValueError,
     r"layer 0's view.*layer_idx is 1"),
    ("dense-view-of-another-layer",
     lambda f: f.dense.run(q(3), "text", f.dkv.layer_view(1), k=kvq(3), v=kvq(3), layer_idx=0, sinks=SINKS),
     ValueError, r"layer 1's view.*layer_idx is 0"),
    ("paged-view-of-another-cache",
     lambda f: f.attn.run(q(3), "text", f.dkv.layer_view(0), layer_idx=0, sinks=SINKS), ValueError,
     r"not a layer of this KV cache.*layer_view\(0\)"),
    ("paged-view-a-copy",
     lambda f: f.attn.run(q(3), "text", f.kv.layer_view(1).clone(), layer_idx=1, sinks=SINKS), ValueError,
     r"not a layer of this KV cache.*layer_view\(1\)"),
    ("paged-view-part-of-a-layer",
     lambda f: f.attn.run(q(3), "text", f.kv.layer_view(1)[:4], layer_idx=1, sinks=SINKS), ValueError,
     r"\(4, 2, 4, 2, 8\).*not a layer"),
    ("paged-view-a-list", lambda f: f.attn.run(q(3), "text", [0], layer_idx=0, sinks=SINKS), TypeError, r"got list"),
    ("paged-layer-bool", lambda f: f.attn.run(q(3), "text", layer_idx=True, sinks=SINKS), IndexError,
     r"layer_idx True"),
    ("write-layer-bool", lambda f: f.kv.write_kv(kvq(3), kvq(3), layer_idx=False, label="text"), IndexError,
     r"layer_idx False"),
    ("runner-query-tokens-past-features",
     lambda f: GraphRunner(f.mnode, lambda c, t: t, buckets=[1, 2], device="cpu", query_tokens=4).warmup(),
     ValueError, r"query_tokens=4.*decode_query_tokens=2"),
    ("paged-sinks-wrong-shape", lambda f: f.attn.run(q(3), "text", layer_idx=0, sinks=SINKS[:2]), ValueError,
     r"\(2,\)"),
]


@pytest.mark.parametrize("name,call,exc,names", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_bad_feature_input_is_refused_by_name_and_changes_nothing(name, call, exc, names):
    f = make_feature_world()
    before = feature_snapshot(f)
    with pytest.raises(exc) as err:
        call(f)
    msg = str(err.value.args[0]) if err.value.args else str(err.value)
    assert re.search(names, msg), f"message does not name the bad value ({names!r}): {msg}"
    assert same(before, feature_snapshot(f)), f"{name}: the managers changed"
    # The worlds still work: each planned step runs with its sinks and its layers' views.
    for layer in (0, 1):
        assert torch.isfinite(f.attn.run(q(3) + 1, "text", f.kv.layer_view(layer), layer_idx=layer,
                                         sinks=SINKS)).all()
        assert torch.isfinite(f.dense.run(q(3) + 1, "text", f.dkv.layer_view(layer), k=kvq(3), v=kvq(3),
                                          layer_idx=layer, sinks=SINKS)).all()


def test_a_declared_sink_logit_is_used():
    """The refusal above is not vacuous: with sinks the output differs from the plain softmax."""
    f = make_feature_world()
    big = torch.full((HQ,), 5.0, dtype=F64)
    kvs = torch.randn(3, HKV, D, dtype=F64)
    f.kv.write_kv(kvs, kvs, layer_idx=0, label="text")
    with_sinks = f.attn.run(q(3) + 1, "text", layer_idx=0, sinks=big)
    without = f.attn.run(q(3) + 1, "text", layer_idx=0, sinks=SINKS - 50.0)
    assert not torch.allclose(with_sinks, without)
