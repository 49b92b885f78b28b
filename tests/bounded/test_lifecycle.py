"""Lifecycle idempotence, graph buffers, build, the kv-span fallback, ieee determinism."""

from __future__ import annotations

import pytest
import torch

from mstar_core.kernels.bounded_attention import table as tb
from mstar_core.resource import BuildInfo
from mstar_core.resources.kv.bounded import BoundedKVConfig, BoundedKVManager, BoundedPlan, BoundedStep, StreamPosition
from mstar_core.step import KVSpan, KVStep, Step, StepContext

CFG = BoundedKVConfig(num_layers=1, max_slots=3, rows=2, num_heads=2, head_dim=8, sink=1, window=3)


def bstep(*spans: tuple[str, int]) -> Step:
    return Step(KVStep(()), extra=(("bounded", BoundedStep(tuple(StreamPosition(r, n) for r, n in spans))),))


def test_ingest_is_idempotent_after_a_step(bk):
    mgr = BoundedKVManager(CFG, "cpu")
    sc = bk.Scenario(CFG, mgr, bk.StreamOracle(CFG), seed=7)
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
    ctx = StepContext(step_index=3)
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    buf = mgr._graph_tables[1]
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
    with pytest.raises(RuntimeError, match="no plan"):
        mgr.current


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


def test_ieee_bit_identical_across_runs(bk):
    def once():
        cfg = BoundedKVConfig(num_layers=2, max_slots=3, rows=2, num_heads=2, head_dim=16, sink=2, window=5, query_window=4)
        sc = bk.make(cfg, seed=11, ieee=True, gqa=2, rel_bias=True, sources=1, row_source=True)
        bk.run_long(sc, n_steps=12, max_span=7)
        return [o for outs in sc.outputs for o in outs], sc.mgr.storage.clone()

    (a, sa), (b, sb) = once(), once()
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(sa, sb)
