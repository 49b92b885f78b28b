"""Lifecycle idempotence, graph buffers, build, the kv-span fallback, ieee determinism."""

from __future__ import annotations

import pytest
import torch

from mstar_core import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedPlan,
    BoundedStep,
    BuildInfo,
    KVSpan,
    KVStep,
    Step,
    StepContext,
    StreamPosition,
)
from mstar_core.kernels.bounded_attention import table as tb

from ...helpers import Scenario, StreamOracle, bstep, make_scenario, run_long

CFG = BoundedKVConfig(num_layers=1, max_slots=3, rows=2, num_heads=2, head_dim=8, sink=1, window=3)


def test_ingest_is_idempotent_after_a_step():
    mgr = BoundedKVManager(CFG, "cpu")
    sc = Scenario(CFG, mgr, StreamOracle(CFG), seed=7)
    sc.step(["a"], [5])
    slot = mgr.slot_of("a")
    mgr.ingest_request("a", {"x": 1})  # another partition's NewRequest
    mgr.ingest_request("a")
    assert mgr.slot_of("a") == slot and mgr.length("a") == 5 and mgr.requests == ("a",)
    sc.step(["a"], [2])  # the stream carries on, checked against the oracle
    mgr.remove_request("never-seen")  # no-op
    mgr.reset_request("never-seen")  # no-op
    mgr.post_warmup_validate()


def test_plan_is_immutable_and_describes_the_step():
    mgr = BoundedKVManager(CFG, "cpu")
    for r in "ab":
        mgr.ingest_request(r)
    ctx = StepContext()
    first = bstep(("a", 6))
    assert mgr.admit(first, ctx)
    mgr.plan(first, ctx)
    mgr.commit(first, ctx)
    step = Step(KVStep(()), extra=(("bounded", BoundedStep((
        StreamPosition("a", 1, start=6), StreamPosition("b", 4, source=-1, source_len=2)))),))
    ctx = StepContext()
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    assert isinstance(plan, BoundedPlan) and mgr.current is plan
    (sa, la, srca), (sb, lb, srcb) = plan.rows
    assert (la.start, la.num_tokens, la.sink_kept, la.ring_kept) == (6, 1, 1, 3)
    assert (lb.start, lb.num_tokens, lb.retained, lb.source_len, srcb) == (0, 4, 0, 2, tb.ROW_SOURCE)
    assert srca == tb.NO_SOURCE and sa != sb
    assert plan.max_retained == 4 and plan.max_span == 4
    assert plan.reads_row_source and not plan.reads_source
    assert plan.retained().tolist() == [4, 0] and plan.retained().dtype == torch.int32
    assert plan.table.dtype == torch.int32 and plan.table.shape == (2, tb.NUM_COLS)
    with pytest.raises(AttributeError):
        plan.max_span = 3


def test_kv_spans_fallback():
    mgr = BoundedKVManager(CFG, "cpu")
    mgr.ingest_request("a")
    step = Step(KVStep((KVSpan("a", "audio", 3),)))
    ctx = StepContext()
    assert mgr.admit(step, ctx)
    assert mgr.plan(step, ctx).rows[0][1].num_tokens == 3
    two = Step(KVStep((KVSpan("a", "audio", 3), KVSpan("a", "text", 1))))
    with pytest.raises(ValueError, match="one span per request"):
        mgr.plan(two, ctx)


def test_graph_buffers_grow_only_and_stage_padded_tables():
    mgr = BoundedKVManager(CFG, "cpu")
    mgr.build_accelerator_graph_buffers(2, 4, 1024)
    first = list(mgr._graph_tables)
    mgr.build_accelerator_graph_buffers(1, 2, 64)  # smaller: changes nothing
    assert [b.data_ptr() for b in mgr._graph_tables] == [b.data_ptr() for b in first]
    mgr.build_accelerator_graph_buffers(2, 6, 64)  # larger: new buffers, old ones kept
    assert all(b.shape == (6, tb.NUM_COLS) for b in mgr._graph_tables)
    assert [r[0].data_ptr() for r in mgr._retired] == [b.data_ptr() for b in first]
    mgr.post_warmup_validate()
    for r in "ab":
        mgr.ingest_request(r)
    step = bstep(("a", 2), ("b", 1))
    ctx = StepContext(slot=1, bucket=4)  # a graph step: staged into its slot's buffer
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    buf = mgr._graph_tables[1]
    assert mgr._graph_tables[0][:2].tolist() == [list(tb.NOOP_ROW)] * 2  # the other slot untouched
    assert plan.table.data_ptr() == buf.data_ptr() and plan.table.shape[0] == 2
    assert buf[2:].tolist() == [list(tb.NOOP_ROW)] * 4
    assert torch.equal(mgr._retired[1][0][:2], plan.table)  # earlier captures see the step too
    # A no-op row attends to nothing and writes nothing.
    q = torch.randn(6 * CFG.rows, 2, 2, 8)
    before = mgr.layer(0).clone()
    padded = plan._replace(table=buf, rows=plan.rows + ((0, CFG.row_layout(0, 0), tb.NO_SOURCE),) * 4)
    out = mgr.attend(0, q, q, q, plan=padded)
    assert out[2 * CFG.rows:].abs().sum() == 0
    from mstar_core.kernels.bounded_attention import bounded_write

    bounded_write(before, q[: 2 * CFG.rows], q[: 2 * CFG.rows], plan.table, sink=CFG.sink, window=CFG.window)
    assert torch.equal(mgr.layer(0), before)  # the padding rows wrote nothing


def test_eager_plans_share_nothing_with_graph_buffers_or_each_other():
    mgr = BoundedKVManager(CFG, "cpu")
    mgr.build_accelerator_graph_buffers(2, 4, 64)
    for r in "ab":
        mgr.ingest_request(r)
    s1, c1 = bstep(("a", 2)), StepContext()
    assert mgr.admit(s1, c1)
    p1 = mgr.plan(s1, c1)
    mgr.commit(s1, c1)
    s2, c2 = bstep(("b", 1)), StepContext()
    assert mgr.admit(s2, c2)
    p2 = mgr.plan(s2, c2)
    graph_ptrs = {b.data_ptr() for b in mgr._graph_tables}
    assert p1.table.data_ptr() != p2.table.data_ptr() and not {p1.table.data_ptr(), p2.table.data_ptr()} & graph_ptrs
    assert p1.table[0, tb.NUM_TOKENS] == 2 and p2.table[0, tb.NUM_TOKENS] == 1  # the next plan left p1 alone
    assert all(b.tolist() == [list(tb.NOOP_ROW)] * 4 for b in mgr._graph_tables)
    # Plan needs this context's admit: the admitted eager context, re-aimed at a graph slot.
    c2.slot, c2.bucket = 2, 4
    with pytest.raises(ValueError, match="staging slot 2 out of range: 2 slots"):
        mgr.plan(s2, c2)
    c2.slot, c2.bucket = 0, 8
    with pytest.raises(ValueError, match="bucket 8; the table buffers hold 4"):
        mgr.plan(s2, c2)


def test_a_step_that_wrote_the_ring_must_commit_before_the_next_plan():
    """attend writes the step's keys over the oldest ring entries; if the step is then dropped
    (a later layer failed), the ring no longer matches the committed length: planning again
    must fail loudly, and reset_request is the way out."""
    mgr = BoundedKVManager(CFG, "cpu", kv_dtype=torch.float64)
    mgr.ingest_request("a")
    s = bstep(("a", 2))
    q = torch.randn(CFG.rows, 2, 2, 8, dtype=torch.float64)
    for abandon in (False, True):
        ctx = StepContext()
        assert mgr.admit(s, ctx)
        mgr.attend(0, q, q, q, plan=mgr.plan(s, ctx))
        if abandon:
            mgr.rollback_admit(s, ctx)  # a later layer failed: the step is dropped after writing
        else:
            mgr.commit(s, ctx)
    assert mgr.slot_of("a") is not None and mgr.length("a") == 2
    ctx = StepContext()
    assert mgr.admit(s, ctx)
    with pytest.raises(RuntimeError,
                       match=r"request 'a': a step from position 2 wrote its keys .* reset_request\('a'\)"):
        mgr.plan(s, ctx)
    mgr.rollback_admit(s, ctx)  # what Node does when plan raises
    mgr.reset_request("a")
    ctx = StepContext()
    assert mgr.admit(s, ctx)
    mgr.plan(s, ctx)
    mgr.attend(0, q, q, q)
    mgr.commit(s, ctx)
    assert mgr.length("a") == 2
    nxt, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(nxt, ctx)
    mgr.plan(nxt, ctx)  # committed: planning goes on


def test_row_source_slots_out_of_range_are_refused():
    mgr = BoundedKVManager(CFG, "cpu", kv_dtype=torch.float64)
    mgr.ingest_request("a")
    s = Step(KVStep(()), extra=(("bounded", BoundedStep((StreamPosition("a", 1, source=-1),))),))
    ctx = StepContext()
    assert mgr.admit(s, ctx)
    plan = mgr.plan(s, ctx)
    q = torch.randn(CFG.rows, 2, 1, 8, dtype=torch.float64)
    store = torch.randn(2, CFG.rows, 2, 3, 16, dtype=torch.float64)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=rf"row_source slots\[0\] = {bad} is out of range: its storage holds 2"):
            mgr.attend(0, q, q, q, plan=plan, row_source=(store, torch.tensor([bad])))
    mgr.attend(0, q, q, q, plan=plan, row_source=(store, torch.tensor([1])))


def test_build_and_cleanup():
    info = BuildInfo(device=torch.device("cpu"), dtype=torch.float64, num_layers=3, num_kv_heads=4, head_dim=16)
    mgr = BoundedKVManager.build({"max_slots": 5, "window": 32, "sink": 4, "rows": 2, "query_window": 16}, info)
    assert mgr.config == BoundedKVConfig(3, 5, 2, 4, 16, 4, 32, 16)
    assert mgr.layer(2).shape == (5, 2, 4, 36, 32) and mgr.layer(0).dtype == torch.float64
    mgr.ingest_request("a")
    ctx = StepContext()
    assert mgr.admit(bstep(("a", 1)), ctx)
    mgr.cleanup()
    assert mgr.requests == () and mgr.num_free_slots == 5 and mgr.storage.numel() == 0
    with pytest.raises(RuntimeError, match="no step is planned"):
        _ = mgr.current


def test_validate_detects_broken_accounting():
    mgr = BoundedKVManager(CFG, "cpu")
    mgr.ingest_request("a")
    assert mgr.admit(bstep(("a", 1)), StepContext())
    mgr._free.append(mgr.slot_of("a"))  # a slot both held and free
    with pytest.raises(RuntimeError, match="slot accounting broken"):
        mgr.post_warmup_validate()


def test_config_rejects_bad_geometry():
    with pytest.raises(ValueError, match="query_window must be in"):
        BoundedKVConfig(1, 1, 1, 1, 8, sink=0, window=4, query_window=5)
    with pytest.raises(ValueError, match="window must be >= 1"):
        BoundedKVConfig(1, 1, 1, 1, 8, sink=0, window=0)


def test_ieee_bit_identical_across_runs():
    """Run-to-run determinism of the whole manager path with ieee=True. On a CPU the reference
    would be deterministic without the flag too; what the flag changes (no TF32, fixed-order
    reductions in the Triton kernel) is checked on the GPU (test_gpu_bounded)."""
    def once():
        cfg = BoundedKVConfig(num_layers=2, max_slots=3, rows=2, num_heads=2, head_dim=16, sink=2, window=5,
                              query_window=4)
        sc = make_scenario(cfg, seed=11, ieee=True, gqa=2, rel_bias=True, sources=1, row_source=True)
        run_long(sc, n_steps=12, max_span=7)
        return [o for outs in sc.outputs for o in outs], sc.mgr.storage.clone()

    (a, sa), (b, sb) = once(), once()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and torch.equal(sa, sb)


@pytest.mark.parametrize("features, named", [
    ({"soft_cap": 30.0}, "soft_cap"),
    ({"sink_logits": True}, "sink_logits"),
    ({"kv_dtype": "fp8_e4m3"}, "fp8_e4m3"),
])
def test_build_refuses_attention_features_the_bounded_kernels_lack(features, named):
    """The bounded kernels declare no attention features; asking for one is refused with a
    reason naming it (not computed without it). Per-layer windows are the paged/dense path's."""
    from mstar_core import AttentionFeatures, BoundedKVManager, BuildInfo

    info = BuildInfo(torch.device("cpu"), num_layers=2, num_kv_heads=2, head_dim=8,
                     features=AttentionFeatures(**features))
    with pytest.raises(ValueError, match=rf"do not support feature\(s\) {named} .* they support none"):
        BoundedKVManager.build({"max_slots": 2, "window": 4}, info)
    windows = BuildInfo(torch.device("cpu"), num_layers=2, num_kv_heads=2, head_dim=8,
                        features=AttentionFeatures(layer_windows=(4, -1)))
    assert BoundedKVManager.build({"max_slots": 2, "window": 4}, windows).config.window == 4
