"""Second, focused tests for BoundedKVManager behaviours that only one other test pinned down
(issue 10): the ring's uncommitted-write mark and reset, the declared start of a step, and
which slot a new request takes."""

from __future__ import annotations

import pytest
import torch

from mstar_core import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedStep,
    KVStep,
    Step,
    StepContext,
    StreamPosition,
)

CFG = BoundedKVConfig(num_layers=1, max_slots=4, rows=1, num_heads=2, head_dim=8, sink=1, window=3)


def bstep(*spans: tuple) -> Step:
    return Step(KVStep(()), extra=(("bounded", BoundedStep(tuple(StreamPosition(*s) for s in spans))),))


def attended_step(mgr: BoundedKVManager, rid: str, n: int, commit: bool) -> None:
    """A step of ``n`` tokens that wrote its keys into the ring, then committed -- or was rolled
    back (a later layer failed), leaving its writes abandoned."""
    s = bstep((rid, n))
    ctx = StepContext()
    assert mgr.admit(s, ctx)
    q = torch.randn(CFG.rows, 2, n, 8, dtype=torch.float64)
    mgr.attend(0, q, q, q, plan=mgr.plan(s, ctx))
    (mgr.commit if commit else mgr.rollback_admit)(s, ctx)


def write_and_abandon(mgr: BoundedKVManager, rid: str, n: int) -> None:
    attended_step(mgr, rid, n, commit=False)


def commit_step(mgr: BoundedKVManager, rid: str, n: int) -> None:
    attended_step(mgr, rid, n, commit=True)


def test_reset_clears_the_ring_mark_of_that_request_only():
    """``reset_request(rid)`` (without ``free``) clears the uncommitted-write mark of ``rid``'s
    slot, so the request plans again from position 0 at once; another request whose ring was
    overwritten by an abandoned step keeps its mark and is still refused."""
    mgr = BoundedKVManager(CFG, "cpu", kv_dtype=torch.float64)
    for r in "ab":
        mgr.ingest_request(r)
        commit_step(mgr, r, 2)
        write_and_abandon(mgr, r, 2)
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


def test_a_declared_start_behind_the_committed_length_is_refused():
    """A step that declares ``start`` must start exactly where its stream is: a start before the
    committed length (positions already in the ring) is refused like one past it."""
    mgr = BoundedKVManager(CFG, "cpu", kv_dtype=torch.float64)
    mgr.ingest_request("a")
    commit_step(mgr, "a", 3)
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
    mgr = BoundedKVManager(CFG, "cpu", kv_dtype=torch.float64)
    for r in "abcd":
        mgr.ingest_request(r)
        commit_step(mgr, r, 1)
    assert [mgr.slot_of(r) for r in "abcd"] == [0, 1, 2, 3]
    mgr.remove_request("b")  # frees 1
    mgr.reset_request("a", free=True)  # frees 0
    mgr.remove_request("d")  # frees 3
    for r, want in (("e", 0), ("f", 1), ("g", 3)):
        mgr.ingest_request(r)
        commit_step(mgr, r, 1)
        assert mgr.slot_of(r) == want, f"{r} took slot {mgr.slot_of(r)}, the lowest free was {want}"
    mgr.post_warmup_validate()
