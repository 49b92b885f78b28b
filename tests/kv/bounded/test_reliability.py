"""What a step took is recorded in its StepContext and released exactly once.

Stale uncommitted-write marks, slots parked for a stale step in flight, the in-flight guard,
commit / plan tied to an admit, all-or-nothing admit, and input validation at the API boundary."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

import mstar_core.kv.bounded.manager as manager_mod
from mstar_core import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedStep,
    KVStep,
    Step,
    StepContext,
    StreamPosition,
)

from ...helpers import bounded_step_through, bstep

CFG = BoundedKVConfig(num_layers=2, max_slots=3, rows=1, num_heads=2, head_dim=8, sink=1, window=3)
ONE_LAYER = BoundedKVConfig(num_layers=1, max_slots=4, rows=1, num_heads=2, head_dim=8, sink=1, window=3)


def new_mgr(*rids: str, max_slots: int = CFG.max_slots) -> BoundedKVManager:
    mgr = BoundedKVManager(dataclasses.replace(CFG, max_slots=max_slots), "cpu", kv_dtype=torch.float64)
    for r in rids:
        mgr.ingest_request(r)
    return mgr


def forward(mgr: BoundedKVManager, plan, seed: int = 0) -> None:
    """Every layer's attend for ``plan`` (what a model's forward does)."""
    gen = torch.Generator().manual_seed(seed)
    T = max(plan.max_span, 1)
    for layer in range(CFG.num_layers):
        q, k, v = (torch.randn(plan.batch * CFG.rows, 2, T, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        mgr.attend(layer, q, k, v, plan=plan)


def run(mgr: BoundedKVManager, step: Step) -> None:
    ctx = StepContext()
    assert mgr.admit(step, ctx)
    forward(mgr, mgr.plan(step, ctx))
    mgr.commit(step, ctx)


def snapshot(mgr: BoundedKVManager, ctx: StepContext | None = None) -> dict:
    """Everything an admit may change: free slots, slot map, lengths, epochs, in-flight steps,
    uncommitted-write marks, and (given) the context's admit record."""
    snap = {
        "free": list(mgr._free),
        "slots": dict(mgr._slot),
        "lengths": dict(mgr._length),
        "epochs": dict(mgr._epoch),
        "in_flight": dict(getattr(mgr, "_in_flight", {})),
        "marks": dict(mgr._uncommitted_writes),
        "parked": dict(getattr(mgr, "_parked", {})),
    }
    if ctx is not None:
        rec = ctx.admitted.get(mgr.name)
        snap["record"] = None if rec is None else (list(rec.fresh), dict(rec.epochs))
    return snap


# -- 1. stale uncommitted-write marks ----------------------------------------------------------


def test_reset_then_attend_leaves_no_mark_and_the_slot_plans_fine(caplog):
    mgr = new_mgr("a")
    run(mgr, bstep(("a", 3)))
    slot = mgr.slot_of("a")
    s1, c1 = bstep(("a", 2)), StepContext()
    assert mgr.admit(s1, c1)
    p1 = mgr.plan(s1, c1)
    mgr.reset_request("a")  # a step in flight: a's slot is parked, a holds none
    assert mgr.slot_of("a") is None and list(mgr.parked_slots.values()) == [slot] and "a" in mgr.requests
    forward(mgr, p1)  # the stale step's layers still run, into the parked slot
    assert mgr._uncommitted_writes == {}
    mgr.post_warmup_validate()
    # The reset request's next step takes a fresh slot and plans: no write it never made is
    # held against it.
    s2, c2 = bstep(("a", 1)), StepContext()
    assert mgr.admit(s2, c2) and mgr.slot_of("a") not in (None, slot)
    assert mgr.plan(s2, c2).rows[0][1].start == 0
    with caplog.at_level(logging.INFO, logger=manager_mod.__name__):
        mgr.commit(s1, c1)  # stale: dropped, and its record consumed
    assert "reset or removed after admit" in caplog.text and mgr.length("a") == 0
    assert mgr.parked_slots == {} and slot in mgr._free  # the stale step landed: its slot is back
    mgr.rollback_admit(s2, c2)
    # Then removed: the next request gets the slot and plans fine.
    mgr.remove_request("a")
    mgr.ingest_request("c")
    s3, c3 = bstep(("c", 2)), StepContext()
    assert mgr.admit(s3, c3) and mgr.slot_of("c") == slot
    forward(mgr, mgr.plan(s3, c3))
    mgr.commit(s3, c3)
    assert mgr.length("c") == 2
    mgr.post_warmup_validate()


def test_remove_between_admit_and_attend_marks_no_free_slot():
    mgr = new_mgr("a")
    run(mgr, bstep(("a", 4)))
    slot = mgr.slot_of("a")
    s1, c1 = bstep(("a", 1)), StepContext()
    assert mgr.admit(s1, c1)
    p1 = mgr.plan(s1, c1)
    mgr.remove_request("a")
    assert slot not in mgr._free and list(mgr.parked_slots.values()) == [slot]  # parked, not free
    forward(mgr, p1)  # writes into the parked slot, which no one else holds
    assert mgr._uncommitted_writes == {}
    mgr.post_warmup_validate()  # would name a mark on a slot no request holds
    mgr.ingest_request("b")
    s2, c2 = bstep(("b", 2)), StepContext()
    assert mgr.admit(s2, c2) and mgr.slot_of("b") not in (None, slot)
    forward(mgr, mgr.plan(s2, c2))
    mgr.commit(s2, c2)
    mgr.commit(s1, c1)  # a's span is dropped (removed after admit), its slot goes back
    assert mgr.length("b") == 2 and mgr.slot_of("a") is None and slot in mgr._free and mgr.parked_slots == {}
    mgr.post_warmup_validate()
    # The slot is free, and free of marks: the next request takes it and plans fine.
    mgr.ingest_request("c")
    run(mgr, bstep(("c", 2)))
    assert mgr.slot_of("c") == slot and mgr.length("c") == 2


# -- 1b. a stale step's writes land only in its parked slot -----------------------------------

# The reproduction: sink 0, window 4 (position p at cache index p % 4).
RING = dataclasses.replace(CFG, sink=0, window=4)


def ring_mgr(*rids: str, max_slots: int) -> BoundedKVManager:
    mgr = BoundedKVManager(dataclasses.replace(RING, max_slots=max_slots), "cpu", kv_dtype=torch.float64)
    for r in rids:
        mgr.ingest_request(r)
    return mgr


def fill(mgr: BoundedKVManager, plan, value: float) -> list[torch.Tensor]:
    """Every layer's attend for ``plan`` with K = V = ``value`` (q random); the outputs."""
    gen = torch.Generator().manual_seed(1)
    T, B, H, D = max(plan.max_span, 1), plan.batch * RING.rows, RING.num_heads, RING.head_dim
    outs = []
    for layer in range(RING.num_layers):
        q = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
        kv = torch.full((B, H, T, D), value, dtype=torch.float64)
        outs.append(mgr.attend(layer, q, kv, kv.clone(), plan=plan))
    return outs


def step_of(mgr: BoundedKVManager, rid: str, n: int, value: float) -> list[torch.Tensor]:
    """Admit, plan, attend (K = V = ``value``) and commit one step of ``rid``; its outputs."""
    s, ctx = bstep((rid, n)), StepContext()
    assert mgr.admit(s, ctx)
    outs = fill(mgr, mgr.plan(s, ctx), value)
    mgr.commit(s, ctx)
    return outs


@pytest.mark.parametrize("land", ["commit", "rollback"])
@pytest.mark.parametrize("how", ["remove", "reset"])
def test_a_stale_step_writes_only_its_parked_slot(how, land):
    """a's step is admitted and planned; a is removed (or reset), then the victim (b, or a's
    restarted stream) takes a slot and commits 7s; a's stale step then attends with NaN K/V and
    lands. The victim's keys and outputs are untouched, and a's old slot was parked (no one could
    take it) until the stale step landed, then went back to the free list once."""
    mgr = ring_mgr("a", "b", "c", max_slots=2)
    sa, ca = bstep(("a", 2)), StepContext()
    assert mgr.admit(sa, ca)
    pa = mgr.plan(sa, ca)
    old = mgr.slot_of("a")
    if how == "remove":
        mgr.remove_request("a")
        victim = "b"
    else:
        mgr.reset_request("a", free=False)
        victim = "a"  # stays ingested without a slot; its next admit takes a fresh one
        assert "a" in mgr.requests and mgr.length("a") == 0
    step_of(mgr, victim, 2, 7.0)
    slot = mgr.slot_of(victim)
    kept = mgr.storage[:, slot].clone()
    fill(mgr, pa, float("nan"))  # the stale step's forward (a replayed graph would write the same)
    assert torch.equal(mgr.storage[:, slot], kept)  # the victim's keys, bit for bit
    assert torch.isnan(mgr.storage[:, old, :, :, :2]).all()  # the stale keys went to a's old slot
    assert mgr._uncommitted_writes == {}  # and marked nothing
    # That slot was parked: no one's, neither held nor free, until the stale step lands.
    assert slot != old and mgr.length(victim) == 2 and mgr._free == []
    assert mgr.parked_slots == {("a", pa.owners[0][1]): old}
    refused = mgr.admit(bstep(("c", 1)), StepContext())  # refused for lack of slots, as a value
    assert not refused and "slots" in refused.reason() and mgr.slot_of("c") is None
    mgr.post_warmup_validate()
    if land == "commit":
        mgr.commit(sa, ca)  # the span is dropped
    else:
        mgr.rollback_admit(sa, ca)
    assert mgr.parked_slots == {} and mgr._free == [old] and mgr.name not in ca.admitted
    mgr.rollback_admit(sa, ca)  # landed already: nothing more goes back
    with pytest.raises(RuntimeError, match="without a live admit"):
        mgr.commit(sa, ca)
    assert mgr._free == [old] and mgr.parked_slots == {}
    mgr.post_warmup_validate()
    # The victim's next output: only 7s to see.
    out = step_of(mgr, victim, 1, 7.0)
    for o in out:
        assert torch.isfinite(o).all() and torch.allclose(o, torch.full_like(o, 7.0))
    assert mgr.length(victim) == 3
    # The slot back in the free list is taken fresh and starts clean.
    step_of(mgr, "c", 1, 1.0)
    assert mgr.slot_of("c") == old and mgr.length("c") == 1
    mgr.post_warmup_validate()


@pytest.mark.parametrize("how", ["remove", "reset"])
def test_one_slot_a_stale_step_holds_it_until_it_lands(how):
    """The reproduction as reported, with one slot: b's admit is refused, as a value, while a's
    stale step is in flight; once that step has written NaN and committed, b takes the slot and
    its outputs are 7s."""
    mgr = ring_mgr("a", "b", max_slots=1)
    sa, ca = bstep(("a", 2)), StepContext()
    assert mgr.admit(sa, ca)
    pa = mgr.plan(sa, ca)
    mgr.remove_request("a") if how == "remove" else mgr.reset_request("a")
    before = snapshot(mgr)
    for rid in ("b",) if how == "remove" else ("b", "a"):  # a reset a needs a fresh slot too
        outcome = mgr.admit(bstep((rid, 2)), StepContext())
        assert not outcome and "slots" in outcome.reason()
    assert snapshot(mgr) == before
    fill(mgr, pa, float("nan"))
    mgr.commit(sa, ca)
    assert mgr._free == [0] and mgr.parked_slots == {}
    step_of(mgr, "b", 2, 7.0)
    assert mgr.slot_of("b") == 0
    for o in step_of(mgr, "b", 1, 7.0):
        assert torch.allclose(o, torch.full_like(o, 7.0))
    mgr.post_warmup_validate()


def test_a_stale_admit_blocks_a_second_admit_in_the_same_context():
    """One context keys its record by request: a request removed and taken again would overwrite
    the record of its stale step (whose parked slot would then never go back). Refused until the
    stale step lands; another context is fine."""
    mgr = ring_mgr("a", max_slots=3)
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    mgr.plan(s, ctx)
    mgr.remove_request("a")
    mgr.ingest_request("a")
    before = snapshot(mgr, ctx)
    with pytest.raises(RuntimeError, match=r"\['a'\] have a step admitted in this context and reset or removed"):
        mgr.admit(s, ctx)
    assert snapshot(mgr, ctx) == before
    other = StepContext()
    assert mgr.admit(s, other) and mgr.slot_of("a") == 1  # slot 0 is parked
    mgr.rollback_admit(s, ctx)  # the stale step lands: slot 0 back
    assert mgr.parked_slots == {} and mgr._free == [2, 0]
    mgr.rollback_admit(s, other)
    assert mgr.admit(s, ctx) and mgr.slot_of("a") == 0  # the context's record is free again
    mgr.rollback_admit(s, ctx)
    assert sorted(mgr._free) == [0, 1, 2] and mgr.slot_of("a") is None
    mgr.post_warmup_validate()


def test_cleanup_clears_parked_slots():
    mgr = ring_mgr("a", max_slots=2)
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    mgr.remove_request("a")
    assert mgr.parked_slots
    mgr.cleanup()
    assert mgr.parked_slots == {} and mgr.num_free_slots == 2


def test_validate_names_a_parked_slot_counted_twice():
    mgr = ring_mgr("a", max_slots=2)
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    mgr.remove_request("a")
    mgr.post_warmup_validate()
    mgr._free.append(next(iter(mgr._parked.values())))  # a slot both parked and free
    with pytest.raises(RuntimeError, match=r"slot accounting broken: 0 held .*, 2 free .*, 1 parked .*, 2 slots"):
        mgr.post_warmup_validate()


def test_a_fresh_slot_starts_clean():
    mgr = new_mgr("a")
    mgr._uncommitted_writes[0] = 7  # a stray mark on a free slot (however it got there)
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx) and mgr.slot_of("a") == 0
    mgr.plan(s, ctx)


# -- 2. one step in flight per request ---------------------------------------------------------


def test_double_admit_in_the_same_context_is_refused():
    mgr = new_mgr("a", "b")
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    before = snapshot(mgr, ctx)
    with pytest.raises(RuntimeError, match=r"\['a'\] already have a step in flight.*commit or roll back"):
        mgr.admit(s, ctx)
    # With another request new to the pool: refused as a whole, b takes no slot.
    with pytest.raises(RuntimeError, match=r"\['a'\] already have a step in flight"):
        mgr.admit(bstep(("b", 1), ("a", 1)), ctx)
    assert snapshot(mgr, ctx) == before and mgr.slot_of("b") is None


def test_double_admit_in_two_contexts_is_refused_until_commit():
    mgr = new_mgr("a")
    s = bstep(("a", 2))
    c1, c2 = StepContext(), StepContext()
    assert mgr.admit(s, c1)
    before = snapshot(mgr)
    with pytest.raises(RuntimeError, match=r"request\(s\) \['a'\] already have a step in flight"):
        mgr.admit(s, c2)
    assert snapshot(mgr) == before and mgr.name not in c2.admitted
    forward(mgr, mgr.plan(s, c1))
    mgr.commit(s, c1)
    assert mgr.admit(s, c2)  # committed: the next step may come
    assert mgr.plan(s, c2).rows[0][1].start == 2
    mgr.rollback_admit(s, c2)
    assert mgr.admit(s, c1)  # rolled back: again


# -- 3. commit and plan tied to an admit -------------------------------------------------------


def test_double_commit_is_refused():
    mgr = new_mgr("a")
    s, ctx = bstep(("a", 2)), StepContext()
    assert mgr.admit(s, ctx)
    forward(mgr, mgr.plan(s, ctx))
    mgr.commit(s, ctx)
    with pytest.raises(RuntimeError, match=r"commit of request\(s\) \['a'\] without a live admit"):
        mgr.commit(s, ctx)
    assert mgr.length("a") == 2


def test_commit_after_rollback_is_refused_and_rollback_twice_is_a_no_op():
    mgr = new_mgr("a")
    run(mgr, bstep(("a", 3)))
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    mgr.plan(s, ctx)
    mgr.rollback_admit(s, ctx)
    before = snapshot(mgr, ctx)
    mgr.rollback_admit(s, ctx)  # Node may roll back everything twice after a failure
    assert snapshot(mgr, ctx) == before
    with pytest.raises(RuntimeError, match=r"\['a'\].*never admitted, committed already, or rolled back"):
        mgr.commit(s, ctx)
    assert mgr.length("a") == 3 and snapshot(mgr, ctx) == before


def test_commit_without_admit_is_refused():
    mgr = new_mgr("a", "b")
    run(mgr, bstep(("a", 3)))
    s, ctx = bstep(("b", 1), ("a", 1)), StepContext()
    assert mgr.admit(bstep(("b", 1)), ctx)  # b admitted here, a not: the whole commit is refused
    before = snapshot(mgr, ctx)
    with pytest.raises(RuntimeError, match=r"commit of request\(s\) \['a'\]"):
        mgr.commit(s, ctx)
    with pytest.raises(RuntimeError, match=r"commit of request\(s\) \['a'\]"):
        mgr.commit(bstep(("a", 1)), StepContext())
    assert snapshot(mgr, ctx) == before and mgr.length("a") == 3 and mgr.length("b") == 0


def test_commit_after_reset_consumes_the_record():
    mgr = new_mgr("a")
    run(mgr, bstep(("a", 3)))
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    mgr.plan(s, ctx)
    mgr.reset_request("a")
    mgr.commit(s, ctx)  # dropped, counted as consumed
    assert mgr.length("a") == 0 and mgr.name not in ctx.admitted
    with pytest.raises(RuntimeError, match=r"\['a'\] without a live admit"):
        mgr.commit(s, ctx)


def test_plan_without_admit_is_refused():
    mgr = new_mgr("a", "b")
    run(mgr, bstep(("a", 3)))  # a holds a slot: only the missing admit is wrong
    with pytest.raises(RuntimeError, match=r"plan before admit: request\(s\) \['a'\]"):
        mgr.plan(bstep(("a", 1)), StepContext())
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    with pytest.raises(RuntimeError, match=r"plan before admit: request\(s\) \['b'\]"):
        mgr.plan(bstep(("a", 1), ("b", 1)), ctx)  # b was not admitted in this context
    mgr.plan(s, ctx)
    mgr.commit(s, ctx)
    with pytest.raises(RuntimeError, match=r"plan before admit: request\(s\) \['a'\]"):
        mgr.plan(s, ctx)  # committed: that admit is used up


def test_plan_after_reset_since_admit_is_refused():
    mgr = new_mgr("a")
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    mgr.reset_request("a")
    with pytest.raises(RuntimeError, match=r"\['a'\] were reset or removed after this step's admit"):
        mgr.plan(s, ctx)


def test_per_request_cycle_still_works():
    """The per-request cycle: one context gathers the admits of several requests, then plan -> forward ->
    commit request by request; a commit drops only its own requests from the record."""
    mgr = new_mgr("a", "b", "c")
    run(mgr, bstep(("a", 2)))
    ctx = StepContext()
    sa, sb, sc = bstep(("a", 1)), bstep(("b", 3)), bstep(("c", 2))
    assert mgr.admit(sa, ctx) and mgr.admit(sb, ctx) and mgr.admit(sc, ctx) and mgr.num_free_slots == 0
    with pytest.raises(RuntimeError, match=r"\['b'\] already have a step in flight"):
        mgr.admit(sb, ctx)
    forward(mgr, mgr.plan(sa, ctx))
    mgr.commit(sa, ctx)
    assert set(ctx.admitted[mgr.name].epochs) == {"b", "c"}
    assert mgr.admit(sa, ctx)  # a's step is over: its next one may join the same context
    forward(mgr, mgr.plan(sb, ctx))
    mgr.commit(sb, ctx)
    forward(mgr, mgr.plan(sa, ctx))
    mgr.commit(sa, ctx)
    mgr.rollback_admit(sc, ctx)  # c's turn never comes: its fresh slot goes back
    assert (mgr.length("a"), mgr.length("b"), mgr.slot_of("c"), mgr.num_free_slots) == (4, 3, None, 1)
    assert mgr.name not in ctx.admitted and mgr._in_flight == {}
    mgr.post_warmup_validate()


# -- 4. all or nothing -------------------------------------------------------------------------


class _Boom:
    """An epoch counter that hands out one number, then raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc, self.calls = exc, 0

    def __iter__(self):
        return self

    def __next__(self) -> int:
        self.calls += 1
        if self.calls > 1:
            raise self.exc
        return 1000


@pytest.mark.parametrize("where", ["epoch counter", "admit record"])
@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_failing_admit_changes_nothing(monkeypatch, where, exc):
    mgr = new_mgr("a", "b", "c", "d", max_slots=4)
    run(mgr, bstep(("a", 3)))
    s0, c0 = bstep(("a", 1)), StepContext()
    assert mgr.admit(s0, c0)
    forward(mgr, mgr.plan(s0, c0))  # a's slot carries a mark
    mgr.rollback_admit(s0, c0)
    ctx = StepContext()
    assert mgr.admit(bstep(("d", 1)), ctx)  # the context already holds another admit
    before = snapshot(mgr, ctx)
    assert before["marks"] and before["record"]
    if where == "epoch counter":
        monkeypatch.setattr(mgr, "_epochs", _Boom(exc))  # fails at the second fresh slot
    else:  # the context refuses the record: the last thing an admit writes
        class Refusing(dict):
            def __setitem__(self, key, value):
                raise exc

            def setdefault(self, key, default=None):
                raise exc

        ctx.admitted = Refusing(ctx.admitted)
    with pytest.raises(type(exc)):
        mgr.admit(bstep(("b", 1), ("c", 1)), ctx)
    assert snapshot(mgr, ctx) == before
    monkeypatch.undo()
    ctx.admitted = dict(ctx.admitted)
    mgr.post_warmup_validate()
    assert mgr.admit(bstep(("b", 1), ("c", 1)), ctx)  # nothing left behind blocks it


def test_bad_input_admit_changes_nothing():
    mgr = new_mgr("a", "b")
    ctx = StepContext()
    assert mgr.admit(bstep(("a", 1)), ctx)
    before = snapshot(mgr, ctx)
    with pytest.raises(KeyError, match=r"\['zz'\] were never ingested"):
        mgr.admit(bstep(("b", 1), ("zz", 1)), ctx)
    with pytest.raises(TypeError, match="expected a Step, got str"):
        mgr.admit("a", ctx)
    with pytest.raises(TypeError, match="must be a BoundedStep, got tuple"):
        mgr.admit(Step(KVStep(()), extra=(("bounded", (StreamPosition("b", 1),)),)), ctx)
    assert snapshot(mgr, ctx) == before


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, CFG.num_layers, 5])
def test_layer_idx_out_of_range_is_refused(bad):
    mgr = new_mgr("a")
    s, ctx = bstep(("a", 2)), StepContext()
    assert mgr.admit(s, ctx)
    plan = mgr.plan(s, ctx)
    store = mgr.storage.clone()
    q = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    with pytest.raises(IndexError, match=rf"attend: layer_idx {bad} out of range: 2 layers \(0..1\)"):
        mgr.attend(bad, q, q, q, plan=plan)
    with pytest.raises(IndexError, match=rf"layer: layer_idx {bad} out of range: 2 layers \(0..1\)"):
        mgr.layer(bad)
    assert torch.equal(mgr.storage, store) and mgr._uncommitted_writes == {}  # nothing written or marked


@pytest.mark.parametrize("bad", [True, 1.0, "0", None])
def test_layer_idx_of_the_wrong_type_is_refused(bad):
    mgr = new_mgr()
    with pytest.raises(TypeError, match=rf"layer_idx must be an int in 0..1, got {type(bad).__name__} {bad!r}"):
        mgr.layer(bad)


def test_qkv_on_another_device_or_not_tensors_are_refused():
    mgr = new_mgr("a")
    s, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(s, ctx)
    plan = mgr.plan(s, ctx)
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    meta = torch.empty(1, 2, 1, 8, dtype=torch.float64, device="meta")
    for args, name in (((meta, q, q), "q"), ((q, meta, q), "k"), ((q, q, meta), "v")):
        with pytest.raises(ValueError, match=rf"attend: {name} is on meta, the cache on cpu"):
            mgr.attend(0, *args, plan=plan)
    with pytest.raises(ValueError, match="rel_bias is on meta"):
        mgr.attend(0, q, q, q, plan=plan, rel_bias=torch.empty(1, 2, 1, 3, device="meta"))
    with pytest.raises(TypeError, match="attend: k must be a torch.Tensor, got list"):
        mgr.attend(0, q, [1.0], q, plan=plan)
    assert mgr._uncommitted_writes == {}


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(num_tokens=True), TypeError, "num_tokens must be an int, got bool True"),
        (dict(num_tokens=1.5), TypeError, "num_tokens must be an int, got float 1.5"),
        (dict(num_tokens="3"), TypeError, "num_tokens must be an int, got str '3'"),
        (dict(num_tokens=-1), ValueError, "num_tokens must be >= 0, got -1"),
        (dict(start=-2), ValueError, "start must be None or >= 0, got -2"),
        (dict(start=2.0), TypeError, "start must be None or an int, got float 2.0"),
        (dict(source=-2), ValueError, r"source must be None, -1 \(row source\) or >= 0, got -2"),
        (dict(source=False), TypeError, "source must be None or an int, got bool False"),
        (dict(source_len=-1), ValueError, "source_len must be None or >= 0, got -1"),
        (dict(commit=1), TypeError, "commit must be a bool, got int 1"),
        (dict(request_id=5), TypeError, "request_id must be a str, got int 5"),
    ],
)
def test_stream_position_fields_are_checked(kwargs, exc, message):
    args = dict(request_id="a", num_tokens=1)
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        StreamPosition(**args)


def test_stream_position_takes_numpy_ints_as_ints_and_refuses_tensors():
    p = StreamPosition("a", np.int64(3), start=np.int32(0))
    assert type(p.num_tokens) is int and p.num_tokens == 3 and type(p.start) is int and p.start == 0
    with pytest.raises(TypeError, match=r"num_tokens must be an int, got Tensor tensor\(3\)"):
        StreamPosition("a", torch.tensor(3))


def test_bounded_step_and_config_fields_are_checked():
    with pytest.raises(TypeError, match="positions must be a tuple of StreamPosition, got StreamPosition"):
        BoundedStep(StreamPosition("a", 1))
    with pytest.raises(TypeError, match=r"positions\[1\] must be a StreamPosition, got tuple \('b', 1\)"):
        BoundedStep((StreamPosition("a", 1), ("b", 1)))
    assert BoundedStep([StreamPosition("a", 1)]).positions == (StreamPosition("a", 1),)
    with pytest.raises(TypeError, match="BoundedKVConfig.num_layers must be an int, got bool True"):
        BoundedKVConfig(True, 1, 1, 1, 8, sink=0, window=4)
    with pytest.raises(TypeError, match="BoundedKVConfig.window must be an int, got float 4.0"):
        BoundedKVConfig(1, 1, 1, 1, 8, sink=0, window=4.0)
    with pytest.raises(TypeError, match="BoundedKVConfig.query_window must be an int, got str '2'"):
        BoundedKVConfig(1, 1, 1, 1, 8, sink=0, window=4, query_window="2")


def test_reset_clears_the_ring_mark_of_that_request_only():
    """``reset_request(rid)`` (without ``free``) clears the uncommitted-write mark of ``rid``'s
    slot, so the request plans again from position 0 at once; another request whose ring was
    overwritten by an abandoned step keeps its mark and is still refused."""
    mgr = BoundedKVManager(ONE_LAYER, "cpu", kv_dtype=torch.float64)
    for r in "ab":
        mgr.ingest_request(r)
        bounded_step_through(mgr, r, 2)
        bounded_step_through(mgr, r, 2, commit=False)
    slot_a = mgr.slot_of("a")
    mgr.reset_request("a")
    assert mgr.slot_of("a") == slot_a and mgr.length("a") == 0
    mgr.post_warmup_validate()
    ctx = StepContext()
    s = bstep(("a", 3))
    assert mgr.admit(s, ctx)
    plan = mgr.plan(s, ctx)  # no "wrote its keys into the ring" refusal after the reset
    assert plan.rows[0][0] == slot_a
    mgr.rollback_admit(s, ctx)
    ctx = StepContext()
    assert mgr.admit(bstep(("b", 1)), ctx)
    with pytest.raises(RuntimeError, match=r"request 'b': a step from position 2 wrote its keys"):
        mgr.plan(bstep(("b", 1)), ctx)
