"""What ``attend`` may run on (a plan whose every admit is in flight), how admit records end,
the checks ``post_warmup_validate`` makes, what ``cleanup`` lets go, and ``build``'s options."""

from __future__ import annotations

import logging

import pytest
import torch

import mstar_core.kv.bounded.manager as manager_mod
from mstar_core import BoundedKVConfig, BoundedKVManager, StepContext, ops
from mstar_core.errors import InputTypeError, StateError
from mstar_core.resource import BuildInfo

from ...helpers import bstep

CFG = BoundedKVConfig(num_layers=2, max_slots=3, rows=1, num_heads=2, head_dim=8, sink=1, window=3)
LANDED = r"no step is planned: this plan's step \(requests \['a'\]\) was committed or rolled back"


def new_mgr(*rids: str) -> BoundedKVManager:
    mgr = BoundedKVManager(CFG, "cpu", kv_dtype=torch.float64)
    for r in rids:
        mgr.ingest_request(r)
    return mgr


def qkv(batch: int = 1, t: int = 1) -> torch.Tensor:
    return torch.randn(batch * CFG.rows, CFG.num_heads, t, CFG.head_dim, dtype=torch.float64)


def attend(mgr: BoundedKVManager, layer: int, plan=None, batch: int = 1) -> torch.Tensor:
    q = qkv(batch, t=max((plan or mgr.current).max_span, 1))
    return mgr.attend(layer, q, q, q, plan=plan)


def run(mgr: BoundedKVManager, *spans) -> None:
    step, ctx = bstep(*spans), StepContext()
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    for layer in range(CFG.num_layers):
        attend(mgr, layer, plan, plan.batch)
    mgr.commit(step, ctx)


# -- what attend may run on --------------------------------------------------------------------


def test_attend_after_the_step_committed_is_refused():
    mgr = new_mgr("a")
    step, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    attend(mgr, 0, plan)
    assert mgr.is_live(plan)
    mgr.commit(step, ctx)
    assert not mgr.is_live(plan)
    with pytest.raises(StateError, match=LANDED):
        attend(mgr, 1, plan)


def test_a_removal_after_a_commit_does_not_revive_the_committed_plan():
    # the commit and the removal both end a step's time in flight: neither may undo the other
    mgr = new_mgr("a", "b")
    run(mgr, ("b", 1))
    step, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    attend(mgr, 0, plan)
    mgr.commit(step, ctx)
    mgr.remove_request("b")
    with pytest.raises(StateError, match=LANDED):
        attend(mgr, 1, plan)


def test_attend_checks_a_plan_other_than_the_last_one_it_ran():
    mgr = new_mgr("a")
    s1, c1 = bstep(("a", 1)), StepContext()
    assert mgr.admit(s1, c1)
    old = mgr.plan(s1, c1)
    attend(mgr, 0, old)
    mgr.commit(s1, c1)
    s2, c2 = bstep(("a", 1)), StepContext()
    assert mgr.admit(s2, c2)
    attend(mgr, 0, mgr.plan(s2, c2))
    with pytest.raises(StateError, match=LANDED):
        attend(mgr, 1, old)


def test_a_plan_dies_when_any_of_its_requests_lands():
    mgr = new_mgr("a", "b")
    step, ctx = bstep(("a", 1), ("b", 1)), StepContext()
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    mgr.commit(bstep(("a", 1)), ctx)  # a lands; b is still in flight
    assert not mgr.is_live(plan)
    with pytest.raises(StateError, match=r"\(requests \['a', 'b'\]\) was committed or rolled back"):
        attend(mgr, 0, plan, batch=2)
    mgr.commit(bstep(("b", 1)), ctx)
    assert (mgr.length("a"), mgr.length("b")) == (1, 1)


def test_attend_defers_to_the_op_only_when_compiling_the_bound_step(monkeypatch):
    mgr = new_mgr("a")
    step, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(step, ctx)
    plan = mgr.plan(step, ctx)
    calls = []

    def op(q, k, v, storage, handle, layer_idx, source, rel_bias, ieee, rs, slots):
        calls.append((handle, layer_idx, ieee, rs, slots))
        return mgr.attend_eager(storage, layer_idx, q, k, v, source, None, rel_bias, ieee, None)

    monkeypatch.setattr(ops, "bounded_attend", op)
    attend(mgr, 0)  # eager, plan None: no op
    assert calls == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    attend(mgr, 0, plan)  # compiling, but a plan given: eager
    assert calls == []
    attend(mgr, 1)  # compiling the bound step: the op, by the manager's handle, fast path
    assert calls == [(mgr.op_handle, 1, False, None, None)]
    assert ops.resolve(mgr.op_handle) is mgr


# -- admit records -----------------------------------------------------------------------------


def test_commit_of_an_unplanned_step_is_refused():
    mgr = new_mgr("a")
    step, ctx = bstep(("a", 1)), StepContext()
    assert mgr.admit(step, ctx)
    with pytest.raises(StateError, match=r"commit of request\(s\) \['a'\], admitted but never planned"):
        mgr.commit(step, ctx)
    assert mgr.length("a") == 0
    mgr.rollback_admit(step, ctx)
    mgr.post_warmup_validate()


def test_a_request_admitted_again_in_its_context_must_be_planned_again():
    mgr = new_mgr("a", "b")
    ctx = StepContext()
    assert mgr.admit(bstep(("a", 1), ("b", 1)), ctx)
    sa = bstep(("a", 1))
    mgr.plan(sa, ctx)
    mgr.commit(sa, ctx)
    assert mgr.admit(sa, ctx)  # a's next step, in the context b's step still holds
    with pytest.raises(StateError, match=r"\['a'\], admitted but never planned"):
        mgr.commit(sa, ctx)


def test_requests_holding_their_slots_commit_one_by_one_from_one_context():
    mgr = new_mgr("a", "b")
    run(mgr, ("a", 1), ("b", 2))
    ctx = StepContext()
    assert mgr.admit(bstep(("a", 1), ("b", 1)), ctx)  # neither takes a slot fresh
    for rid in "ab":
        step = bstep((rid, 1))
        mgr.plan(step, ctx)
        mgr.commit(step, ctx)
    assert (mgr.length("a"), mgr.length("b")) == (2, 3) and mgr.name not in ctx.admitted


def test_an_admit_record_of_another_kind_is_refused():
    mgr = new_mgr("a")
    ctx = StepContext()
    ctx.admitted[mgr.name] = {"a": 1}
    with pytest.raises(InputTypeError, match=r"is a dict, not this manager's admit record: two resources share "
                                             r"the name 'bounded'\?"):
        mgr.admit(bstep(("a", 1)), ctx)
    assert mgr.slot_of("a") is None and mgr.num_free_slots == CFG.max_slots


def test_removing_an_unknown_request_is_a_no_op(caplog):
    mgr = new_mgr("a")
    run(mgr, ("a", 2))
    with caplog.at_level(logging.DEBUG, logger=manager_mod.__name__):
        mgr.remove_request("ghost")
    assert "remove_request('ghost'): unknown request, nothing to do" in caplog.text
    assert mgr.requests == ("a",) and mgr.length("a") == 2


def test_a_reset_in_flight_parks_the_slot_without_its_mark():
    mgr = new_mgr("a")
    step, ctx = bstep(("a", 2)), StepContext()
    assert mgr.admit(step, ctx)
    attend(mgr, 0, mgr.plan(step, ctx))
    slot = mgr.slot_of("a")
    mgr.reset_request("a")
    assert list(mgr.parked_slots.values()) == [slot] and mgr._uncommitted_writes == {}
    mgr.post_warmup_validate()


# -- post_warmup_validate and cleanup -----------------------------------------------------------


def _double_count(mgr):
    mgr._free[-1] = mgr.slot_of("a")  # as many entries as slots, one slot twice


def _park_live(mgr):
    mgr._parked[("a", mgr._epoch["a"])] = mgr._slot.pop("a")


def _stray(mgr):
    mgr._slot["ghost"] = mgr._free.pop()


def _loose(mgr):
    mgr._uncommitted_writes[mgr._free[0]] = 0


def _adrift(mgr):
    mgr._in_flight["a"] = -1


def _sizes(mgr):
    mgr.build_accelerator_graph_buffers(2, 4, 64)
    mgr._graph_tables[1] = mgr._graph_tables[1].repeat(2, 1)


@pytest.mark.parametrize("corrupt, message", [
    (_double_count, "slot accounting broken: 1 held"),
    (_park_live, r"slots parked for steps whose requests are unchanged since admit: \[\('a', \d+\)\]"),
    (_stray, r"slots held by requests never ingested: \['ghost'\]"),
    (_loose, r"uncommitted-write marks on slots no request holds: \[\d\]"),
    (_adrift, r"steps in flight for requests reset or without a slot: \['a'\]"),
    (_sizes, r"graph table buffers differ in size: \[4, 8\]"),
], ids=["double count", "parked live", "stray", "loose mark", "adrift", "buffer sizes"])
def test_validate_names_each_kind_of_broken_state(corrupt, message):
    mgr = new_mgr("a")
    assert mgr.admit(bstep(("a", 1)), StepContext())
    mgr.post_warmup_validate()
    corrupt(mgr)
    with pytest.raises(StateError, match=message):
        mgr.post_warmup_validate()


def test_cleanup_lets_go_of_every_request_plan_and_buffer():
    mgr = new_mgr("a", "b")
    mgr.build_accelerator_graph_buffers(1, 2, 64)
    mgr.build_accelerator_graph_buffers(1, 4, 64)  # one buffer retired
    run(mgr, ("b", 1))
    step, ctx = bstep(("a", 2), ("b", 1)), StepContext()
    assert mgr.admit(step, ctx)
    attend(mgr, 0, mgr.plan(step, ctx), batch=2)  # marks, a plan seen and marked
    mgr.reset_request("a")  # a's slot parked
    mgr.cleanup()
    held = (mgr._slot, mgr._length, mgr._requests, mgr._graph_tables, mgr._retired, mgr._uncommitted_writes,
            mgr._epoch, mgr._in_flight, mgr._live_admits, mgr._parked)
    assert all(len(c) == 0 for c in held)
    assert (mgr._marked, mgr._seen_live, mgr._current) == (None, None, None)
    assert mgr.num_free_slots == CFG.max_slots and mgr.storage.numel() == 0
    with pytest.raises(StateError, match="no step is planned"):
        _ = mgr.current


def test_build_takes_name_impl_and_sm_scale():
    info = BuildInfo(device=torch.device("cpu"), dtype=torch.float64, num_layers=1, num_kv_heads=2, head_dim=8)
    spec = {"max_slots": 1, "window": 4}
    plain = BoundedKVManager.build(spec, info)
    assert (plain.name, plain.impl, plain.sm_scale) == ("bounded", "auto", None)
    mgr = BoundedKVManager.build({**spec, "name": "kv2", "impl": "reference", "sm_scale": 0.25}, info)
    assert (mgr.name, mgr.impl, mgr.sm_scale) == ("kv2", "reference", 0.25)
    outs = []
    for m in (plain, mgr):
        m.ingest_request("a")
        step, ctx = bstep(("a", 2)), StepContext()
        assert m.admit(step, ctx)
        assert ctx.admitted.keys() == {m.name}
        q = torch.arange(32, dtype=torch.float64).reshape(1, 2, 2, 8) / 10
        outs.append(m.attend(0, q, q, q, plan=m.plan(step, ctx)))
    assert not torch.allclose(outs[0], outs[1])  # the scale reaches the kernel
