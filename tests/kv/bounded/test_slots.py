"""Slot exhaustion, rollback, remove and re-admit, reset."""

from __future__ import annotations

import pytest
import torch

from mstar_core import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedStep,
    KVStep,
    Shortage,
    Step,
    StepContext,
    StreamPosition,
)

from ...helpers import Scenario, StreamOracle, bounded_step_through, bstep

CFG = BoundedKVConfig(num_layers=2, max_slots=2, rows=1, num_heads=2, head_dim=8, sink=2, window=4)
ONE_LAYER = BoundedKVConfig(num_layers=1, max_slots=4, rows=1, num_heads=2, head_dim=8, sink=1, window=3)


def run(mgr: BoundedKVManager, step: Step, gen: torch.Generator) -> torch.Tensor:
    ctx = StepContext()
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    B, T = plan.batch, max(plan.max_span, 1)
    out = None
    for layer in range(CFG.num_layers):
        q, k, v = (torch.randn(B, 2, T, 8, generator=gen) for _ in range(3))
        out = mgr.attend(layer, q, k, v)
    mgr.commit(step, ctx)
    return out


def test_exhaustion_refuses_with_shortage_and_takes_nothing():
    mgr = BoundedKVManager(CFG, "cpu")
    gen = torch.Generator().manual_seed(0)
    for r in "abcd":
        mgr.ingest_request(r)
    run(mgr, bstep(("a", 5)), gen)
    slot_a, store = mgr.slot_of("a"), mgr.storage.clone()
    # c and d both new, one slot free: refused as a value naming the shortage.
    ctx = StepContext()
    outcome = mgr.admit(bstep(("a", 1), ("c", 3), ("d", 3)), ctx)
    assert not outcome
    assert outcome.shortages[0] == Shortage("bounded", "slots", 2, 1)
    assert {s.request_id for s in outcome.shortages[1:]} == {"c", "d"}
    assert "slots" in outcome.reason() and "needs 2" in outcome.reason()
    assert mgr.slot_of("c") is None and mgr.slot_of("d") is None and mgr.num_free_slots == 1
    assert mgr.slot_of("a") == slot_a and mgr.length("a") == 5 and torch.equal(mgr.storage, store)
    mgr.post_warmup_validate()


def test_rollback_frees_only_fresh_slots():
    mgr = BoundedKVManager(CFG, "cpu")
    gen = torch.Generator().manual_seed(1)
    for r in "ab":
        mgr.ingest_request(r)
    run(mgr, bstep(("a", 7)), gen)
    slot_a, store = mgr.slot_of("a"), mgr.storage.clone()
    step = bstep(("a", 1), ("b", 2))
    ctx = StepContext()
    assert mgr.admit(step, ctx)
    assert mgr.slot_of("b") is not None and mgr.num_free_slots == 0
    mgr.rollback_admit(step, ctx)  # another resource refused
    assert mgr.slot_of("b") is None and mgr.num_free_slots == 1
    assert mgr.slot_of("a") == slot_a and mgr.length("a") == 7 and torch.equal(mgr.storage, store)
    assert "bounded" not in ctx.admitted
    mgr.post_warmup_validate()
    # The step admits again after the rollback.
    run(mgr, step, gen)
    assert mgr.length("a") == 8 and mgr.length("b") == 2


def test_per_request_cycle_commit_keeps_other_requests_fresh_slots():
    """The per-request cycle: admit may run for every request first, then plan -> forward -> commit per
    request. Committing one request must not forget the slot another took fresh, so that a
    rollback of the other still frees it."""
    mgr = BoundedKVManager(CFG, "cpu")
    gen = torch.Generator().manual_seed(2)
    for r in "ab":
        mgr.ingest_request(r)
    ctx = StepContext()
    sa, sb = bstep(("a", 3)), bstep(("b", 2))
    assert mgr.admit(sa, ctx) and mgr.admit(sb, ctx) and mgr.num_free_slots == 0
    mgr.plan(sa, ctx)
    mgr.attend(0, *(torch.randn(1, 2, 3, 8, generator=gen) for _ in range(3)))
    mgr.commit(sa, ctx)
    mgr.rollback_admit(sb, ctx)  # b's turn never comes
    assert mgr.slot_of("b") is None and mgr.num_free_slots == 1 and mgr.length("a") == 3
    assert "bounded" not in ctx.admitted
    mgr.post_warmup_validate()


def test_a_step_committed_after_its_request_was_reset_is_dropped():
    """Reset between admit and commit: the stream restarts at 0 and the stale step's tokens do
    not count (the paged manager drops such a span too, so the two stay in agreement)."""
    mgr = BoundedKVManager(CFG, "cpu")
    gen = torch.Generator().manual_seed(3)
    mgr.ingest_request("a")
    run(mgr, bstep(("a", 3)), gen)
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    mgr.plan(s, ctx)
    mgr.reset_request("a")
    mgr.commit(s, ctx)
    assert mgr.length("a") == 0 and "bounded" not in ctx.admitted
    mgr.remove_request("a")  # and after remove + re-admit, an old rollback frees only its parked slot
    mgr.ingest_request("a")
    old, c_old = bstep(("a", 1)), StepContext()
    assert mgr.admit(old, c_old)
    slot = mgr.slot_of("a")
    mgr.remove_request("a")  # old is in flight: its slot is parked until old lands, not free
    mgr.ingest_request("a")
    assert mgr.admit(bstep(("a", 1)), StepContext()) and mgr.slot_of("a") not in (None, slot)
    new = mgr.slot_of("a")
    mgr.rollback_admit(old, c_old)  # the parked slot goes back; a's new slot stays a's
    assert mgr.slot_of("a") == new and mgr.num_free_slots == 1 and mgr.parked_slots == {}
    mgr.post_warmup_validate()


def test_remove_then_readmit_reuses_slot_without_stale_keys():
    mgr = BoundedKVManager(CFG, "cpu")
    sc = Scenario(CFG, mgr, StreamOracle(CFG), seed=5)
    for _ in range(4):
        sc.step(["a", "b"], [5, 3])
    slot_a = mgr.slot_of("a")
    assert mgr.layer(0)[slot_a].abs().sum() > 0  # a's keys are still in the slot
    mgr.remove_request("a")
    sc.oracle.forget("a")
    assert mgr.num_free_slots == 1 and mgr.slot_of("a") is None
    mgr.remove_request("a")  # idempotent
    # c takes a's old slot and must read none of a's keys (the oracle has c's stream only).
    sc.step(["c", "b"], [1, 1])
    assert mgr.slot_of("c") == slot_a
    for _ in range(6):
        sc.step(["c", "b"], [2, 1])
    # The same request id, removed and back: a fresh stream.
    mgr.remove_request("b")
    sc.oracle.forget("b")
    sc.step(["b"], [3])
    assert mgr.length("b") == 3
    mgr.post_warmup_validate()


def test_reset_keeps_slot_and_restarts_stream():
    mgr = BoundedKVManager(CFG, "cpu")
    sc = Scenario(CFG, mgr, StreamOracle(CFG), seed=6)
    sc.step(["a"], [9])
    slot = mgr.slot_of("a")
    store = mgr.storage.clone()
    mgr.reset_request("a")
    assert torch.equal(mgr.storage, store)  # nothing zeroed
    assert mgr.slot_of("a") == slot and mgr.length("a") == 0
    sc.oracle.forget("a")
    sc.step(["a"], [1])  # sees only its own new key, not the 9 old ones
    sc.step(["a"], [4])
    mgr.reset_request("a", free=True)
    assert mgr.slot_of("a") is None and mgr.num_free_slots == CFG.max_slots and "a" not in mgr.requests
    mgr.post_warmup_validate()


def test_plan_errors_name_what_is_wrong():
    mgr = BoundedKVManager(CFG, "cpu")
    mgr.ingest_request("a")
    with pytest.raises(KeyError, match="never ingested"):
        mgr.admit(bstep(("zz", 1)), StepContext())
    with pytest.raises(RuntimeError, match="plan before admit"):
        mgr.plan(bstep(("a", 1)), StepContext())
    ctx = StepContext()
    bad = Step(KVStep(()), extra=(("bounded", BoundedStep((StreamPosition("a", 2, start=3),))),))
    assert mgr.admit(bad, ctx)
    with pytest.raises(ValueError, match="declares start 3.*holds 0"):
        mgr.plan(bad, ctx)
    src = Step(KVStep(()), extra=(("bounded", BoundedStep((StreamPosition("a", 1, source=0),))),))
    mgr.plan(src, ctx)
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="reads source"):
        mgr.attend(0, q, q, q)
    with pytest.raises(ValueError, match="shorter than the step's longest span"):
        mgr.plan(bstep(("a", 3)), ctx)
        mgr.attend(0, q, q, q)


def test_a_declared_start_behind_the_committed_length_is_refused():
    """A step that declares ``start`` must start exactly where its stream is: a start before the
    committed length (positions already in the ring) is refused like one past it."""
    mgr = BoundedKVManager(ONE_LAYER, "cpu", kv_dtype=torch.float64)
    mgr.ingest_request("a")
    bounded_step_through(mgr, "a", 3)
    for start in (0, 2):
        s = bstep(("a", 1, start))
        ctx = StepContext()
        assert mgr.admit(s, ctx)
        with pytest.raises(ValueError, match=rf"'a' declares start {start}, but its stream holds 3"):
            mgr.plan(s, ctx)
        mgr.rollback_admit(s, ctx)
    s = bstep(("a", 1, 3))  # exactly where the stream is: fine
    ctx = StepContext()
    assert mgr.admit(s, ctx)
    assert mgr.plan(s, ctx).rows[0][1].start == 3


def test_a_new_request_takes_the_lowest_free_slot():
    """Slots are handed out lowest first, also after requests were freed in any order: the
    same sequence of calls always gives the same slots."""
    mgr = BoundedKVManager(ONE_LAYER, "cpu", kv_dtype=torch.float64)
    for r in "abcd":
        mgr.ingest_request(r)
        bounded_step_through(mgr, r, 1)
    assert [mgr.slot_of(r) for r in "abcd"] == [0, 1, 2, 3]
    mgr.remove_request("b")  # frees 1
    mgr.reset_request("a", free=True)  # frees 0
    mgr.remove_request("d")  # frees 3
    for r, want in (("e", 0), ("f", 1), ("g", 3)):
        mgr.ingest_request(r)
        bounded_step_through(mgr, r, 1)
        assert mgr.slot_of(r) == want, f"{r} took slot {mgr.slot_of(r)}, the lowest free was {want}"
    mgr.post_warmup_validate()
