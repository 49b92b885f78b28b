"""A hypothesis state machine over the bounded KV manager and bounded attention, driven through
``Node`` and ``GraphRunner`` (on a CPU the bounded manager cannot be captured, so the runner runs
every step eagerly; prepare / launch / discard still go through it).

Operations: ingest; steps over a few requests (0..6 tokens each, longer than the window and the
whole slot, commit True/False, with or without the ``"bounded"`` step part, a declared ``start``
that is right or stale) through ``GraphRunner.prepare`` + ``launch``, through ``Node.step``, or
prepared and left pending (a second prepare for other requests comes before the first launch);
launch, discard or failing launch of a pending step; a forward that ``attend``s with NaN/inf K/V
and then raises; reset (free or not, also of a request whose step is pending: the step goes
stale); remove; a double commit and a second launch; a double admit of a request in flight.

After every operation the manager is checked against a model: which slot each request holds (a
request keeps it from its first admit to its removal or to a reset while a step of it is
pending, no slot twice, free + held + parked = all), which slots are parked (that of a request
reset or removed while a step of it was pending, until that step lands: launched, failed or
discarded; a request reset that way takes a fresh slot at its next admit, and is refused for
lack of slots as a value), each stream's committed length, nothing in flight but the live
pending steps, and every retained K/V entry in the storage, of held slots and of parked ones
(the first ``sink`` positions at their own index, the last ``window`` at ``sink + (p - sink) %
window``). A step whose forward wrote the ring and then failed leaves its (non-fresh) requests
refused at their next plan, naming ``reset_request``, until reset.

The forward writes K/V that encode (layer, row, head, dim, stream code, position), the code being
new whenever a request's stream restarts, and queries are 0: every query's output is the mean of
the V it may see (``kernels/bounded_attention``: sinks, ring, own step causally), predicted exactly
by the model, so a key read from the wrong slot, position, epoch or a NaN shows.

A pending step whose request was reset or removed (stale) is launched, failed or discarded
whenever the rules pick it, whoever holds slots by then: its ``attend`` writes by the plan's
table into the request's old slot, which stays parked until the step lands, so no other stream's
keys are touched (the invariant checks them) and its own queries still see exactly the old
stream's retained keys (checked like a live step's; only its commit is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mstar_core import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedStep,
    GraphRunner,
    KVSpan,
    KVStep,
    Node,
    Step,
    StreamPosition,
)
from mstar_core.graphs import Prepared

RIDS = ("a", "b", "c", "d", "e")
LAYERS, SLOTS, ROWS, H, GQA, D, SINK, WINDOW = 2, 3, 2, 2, 2, 2, 2, 3
CFG = BoundedKVConfig(LAYERS, SLOTS, ROWS, H, D, SINK, WINDOW)
MAX_SPAN = 6  # > window and > sink + window: a span may overrun the whole slot

# Index of every (row, head, dim) entry, per layer: the leading part of the value K/V encode.
_IDX = ((torch.arange(ROWS)[:, None, None] * H + torch.arange(H)[None, :, None]) * D
        + torch.arange(D)[None, None, :]).to(torch.float64)  # [ROWS, H, D]


class Boom(Exception):
    """The forward's planted failure."""


def values(layer: int, code: int, pos: list[int]) -> torch.Tensor:
    """V of stream ``code`` at positions ``pos``: ``[ROWS, H, len(pos), D]``, exact in float64.
    K is ``-V - 0.5`` (so a K/V swap shows too)."""
    p = torch.tensor(pos, dtype=torch.float64)
    idx = _IDX + layer * ROWS * H * D
    return (idx[:, :, None, :] * 1e6 + code * 1000 + p[None, None, :, None]).contiguous()


def retained(length: int) -> list[int]:
    """Stream positions a slot retains after ``length`` committed tokens."""
    return list(range(min(length, SINK))) + list(range(max(SINK, length - WINDOW), length))


def cache_index(p: int) -> int:
    return p if p < SINK else SINK + (p - SINK) % WINDOW


@dataclass
class Row:
    """One request of a step, as the model saw it at admit."""

    rid: str
    n: int
    commit: bool
    start: int  # committed length at admit
    code: int  # the stream's code at admit: the step is stale once it changed (reset / remove)
    fresh: bool  # the admit took the request's slot
    slot: int | None = None


@dataclass
class Pending:
    prep: Prepared
    tokens: torch.Tensor
    rows: list[Row]


class BoundedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = BoundedKVManager(CFG, "cpu", torch.float64)
        self.mgr.impl = "reference"
        self.node = Node([self.mgr])
        self.runner = GraphRunner(self.node, self.forward, buckets=[1, 2, 4], device="cpu", slots=2)
        self.runner.warmup()
        assert not self.runner.enabled  # the reference kernel cannot be captured: all eager
        self.poison: float | None = None  # the forward writes this as K/V, then raises
        self.fail_after = LAYERS  # ... after this many layers
        self.ingested: set[str] = set()
        self.codes = iter(range(1, 10**6))
        self.code: dict[str, int] = {}  # the current stream's code, per ingested request
        self.slot: dict[str, int] = {}  # slot held, per request
        self.length: dict[str, int] = {}  # committed length, per request holding a slot
        self.taint: dict[str, int] = {}  # request -> start of its step that wrote and failed
        # (request, code of its stale pending step) -> the row: the slot parked for that step
        # (row.slot), which still holds the old stream's keys up to row.start.
        self.parked: dict[tuple[str, int], Row] = {}
        self.pending: list[Pending] = []

    # -- the forward ----------------------------------------------------------------------------
    def forward(self, ctx, tokens):
        """Each layer: K/V of every request's tokens at their stream positions, q = 0, then
        ``attend`` (the plan the runner bound for this step). Returns the layers' outputs."""
        plan = ctx.plan_results["bounded"]
        B, T = plan.batch, max(plan.max_span, 1)
        rows, i = [], 0
        for b, (_, lay, _) in enumerate(plan.rows):
            if lay.num_tokens:
                code = int(tokens[i])
                assert (tokens[i: i + lay.num_tokens] == code).all()
                rows.append((b, code, list(range(lay.start, lay.start + lay.num_tokens))))
            i += lay.num_tokens
        assert i == tokens.numel()
        outs = []
        for layer in range(LAYERS):
            k = torch.zeros(B * ROWS, H, T, D, dtype=torch.float64)
            v = torch.zeros_like(k)
            for b, code, pos in rows:
                val = values(layer, code, pos)
                v[b * ROWS:(b + 1) * ROWS, :, : len(pos)] = val
                k[b * ROWS:(b + 1) * ROWS, :, : len(pos)] = -val - 0.5
            if self.poison is not None:
                k.fill_(self.poison)
                v.fill_(self.poison)
            outs.append(self.mgr.attend(layer, torch.zeros(B * ROWS, H * GQA, T, D, dtype=torch.float64), k, v))
            if self.poison is not None and layer + 1 == self.fail_after:
                raise Boom("planted")
        return outs

    # -- model helpers --------------------------------------------------------------------------
    def live(self, row: Row) -> bool:
        """Whether the request's stream is still the one the step was admitted for (a reset gives
        it a new code, a removal drops it)."""
        return self.code.get(row.rid) == row.code

    def busy(self) -> set[str]:
        return {r.rid for p in self.pending for r in p.rows if self.live(r)}

    def snapshot(self):
        m = self.mgr
        return (sorted(m._free), dict(m._slot), dict(m._length), dict(m._epoch), dict(m._in_flight),
                dict(m._uncommitted_writes), m.storage.view(torch.int64).clone())

    def same(self, before) -> None:
        now = self.snapshot()
        assert now[:-1] == before[:-1]
        assert torch.equal(now[-1], before[-1])  # bit for bit (NaN included)

    def spec(self, rids, lens, commits, avoid_busy=True):
        busy = self.busy() if avoid_busy else set()
        return [(r, n, c) for r, n, c in zip(rids, lens, commits, strict=False) if r in self.ingested and r not in busy]

    def build(self, spec, fallback: bool, declare: str | None):
        positions = []
        for i, (r, n, c) in enumerate(spec):
            start = None
            if declare == "exact":
                start = self.length.get(r, 0)
            elif declare == "wrong" and i == 0:
                start = self.length.get(r, 0) + 1
            positions.append(StreamPosition(r, n, start=start, commit=c))
        extra = () if fallback else (("bounded", BoundedStep(tuple(positions))),)
        step = Step(KVStep(tuple(KVSpan(r, "text", n, c) for r, n, c in spec)), extra=extra)
        tokens = torch.tensor([self.code[r] for r, n, _ in spec for _ in range(n)], dtype=torch.long)
        rows = [Row(r, n, c, self.length.get(r, 0), self.code[r], r not in self.slot) for r, n, c in spec]
        return step, tokens, rows

    def predict(self, spec, declare):
        """What admit + plan will say: in flight, short of slots, refused at plan, or planned."""
        if any(r in self.busy() for r, _, _ in spec):
            return "busy", None
        fresh = [r for r, _, _ in spec if r not in self.slot]
        if len(fresh) > SLOTS - len(self.slot) - len(self.parked):
            return "slots", None
        for i, (r, _, _) in enumerate(spec):  # plan checks request by request, in step order
            if r in self.taint:
                return "taint", r
            if declare == "wrong" and i == 0:
                return "start", r
        return "ok", None

    def refused(self, kind, rid, call) -> None:
        """``call`` (a prepare or a node step) must be refused as predicted, changing nothing."""
        before = self.snapshot()
        if kind == "busy":
            with pytest.raises(RuntimeError, match="already have a step in flight"):
                call()
        elif kind == "slots":
            res = call()
            assert not res.outcome and "slots" in res.outcome.reason()
        elif kind == "taint":
            with pytest.raises(RuntimeError, match=rf"request '{rid}': a step from position {self.taint[rid]} "
                                                   rf"wrote its keys.*reset_request\('{rid}'\)"):
                call()
        else:
            n = self.length.get(rid, 0)
            with pytest.raises(ValueError, match=rf"'{rid}' declares start {n + 1}, but its stream holds {n}"):
                call()
        self.same(before)
        event(f"refused: {kind}")

    def took(self, rows, plan) -> None:
        """After a successful admit + plan: the model's slots follow (fresh ones were free)."""
        for b, row in enumerate(rows):
            slot = self.mgr.slot_of(row.rid)
            if row.fresh:
                taken = [*self.slot.values(), *(p.slot for p in self.parked.values())]
                assert slot is not None and slot not in taken, (row, slot, self.slot, self.parked)
                self.slot[row.rid], self.length[row.rid] = slot, 0
            assert slot == self.slot[row.rid]
            row.slot = slot
            if plan is not None:
                s, lay, _ = plan.rows[b]
                assert (s, lay.start, lay.num_tokens, lay.commit) == (slot, row.start, row.n, row.commit)

    def expect(self, rows, outs) -> None:
        """Each request's queries: the mean of the V they may see. A stale row too: it reads its
        parked slot, which still holds its old stream's keys."""
        for b, row in enumerate(rows):
            if not self.live(row):
                assert self.parked[(row.rid, row.code)] is row
                event("stale row's outputs checked")
            for layer, out in enumerate(outs):
                assert out.shape[0] == len(rows) * ROWS and out.shape[2:] == (H * GQA, D)
                for t in range(row.n):
                    seen = retained(row.start) + list(range(row.start, row.start + t + 1))
                    want = values(layer, row.code, seen).mean(dim=2).repeat_interleave(GQA, dim=1)
                    got = out[b * ROWS:(b + 1) * ROWS, t]
                    assert torch.allclose(got, want, rtol=1e-12, atol=0), (row, layer, t, got, want)

    def landed(self, rows, outs) -> None:
        self.expect(rows, outs)
        for row in rows:
            if not self.live(row):
                event("stale span dropped at commit")
                self.unpark(row)
                continue
            if row.commit:
                self.length[row.rid] += row.n
        if any(r.n > WINDOW and r.commit for r in rows):
            event("committed a span longer than the window")

    def failed(self, rows) -> None:
        """The forward wrote (poison) and raised: the admit was rolled back."""
        for row in rows:
            if not self.live(row):
                event("failed stale row: no mark")
                self.unpark(row)
            elif row.fresh:  # its slot went back (node.step: the model never saw it taken)
                self.slot.pop(row.rid, None)
                self.length.pop(row.rid, None)
            elif row.commit and row.n:
                self.taint[row.rid] = row.start
                event("ring written, step failed: request tainted")

    def rolled_back(self, rows) -> None:
        for row in rows:
            if not self.live(row):
                self.unpark(row)
            elif row.fresh:
                self.slot.pop(row.rid)
                self.length.pop(row.rid)

    def park(self, rid) -> None:
        """``rid``, whose step is pending, is reset or removed: it no longer holds its slot, which
        is parked until that step lands."""
        row = next(r for p in self.pending for r in p.rows if r.rid == rid and self.live(r))
        assert self.slot.pop(rid) == row.slot
        self.length.pop(rid)
        self.parked[(rid, row.code)] = row

    def unpark(self, row) -> None:
        """A stale row's step landed (committed, failed or discarded): its parked slot is free."""
        assert self.parked.pop((row.rid, row.code)) is row
        event("parked slot back")

    # -- running steps --------------------------------------------------------------------------
    def run(self, spec, how, fallback=False, declare=None, poison=None, fail_after=LAYERS):
        if not spec:
            return
        step, tokens, rows = self.build(spec, fallback, declare)
        kind, rid = self.predict(spec, declare)
        if kind != "ok":
            if how == "node":
                self.refused(kind, rid, lambda: self.node.step(step, lambda ctx: self.forward(ctx, tokens)))
            else:
                self.refused(kind, rid, lambda: self.runner.prepare(step))
            return
        if fallback:
            event("step without a 'bounded' part (kv spans)")
        if not any(r.commit for r in rows):
            event("step with commit=False only")
        if how == "node":
            self.node_step(step, tokens, rows, poison, fail_after)
            return
        prep = self.runner.prepare(step)
        assert prep.outcome and prep.graph is None
        self.took(rows, prep.ctx.plan_results["bounded"])
        pend = Pending(prep, tokens, rows)
        if how == "pending":
            self.pending.append(pend)
            event(f"left pending ({len(self.pending)} pending)")
        else:
            self.launch(pend, poison, fail_after)

    def node_step(self, step, tokens, rows, poison, fail_after):
        fwd = lambda ctx: self.forward(ctx, tokens)  # noqa: E731
        if poison is not None:
            self.poison, self.fail_after = poison, fail_after
            try:
                with pytest.raises(Boom):
                    self.node.step(step, fwd)
            finally:
                self.poison, self.fail_after = None, LAYERS
            self.failed(rows)
            event("failing forward (node.step)")
            return
        res = self.node.step(step, fwd)
        assert res.outcome
        self.took(rows, res.ctx.plan_results["bounded"])
        self.landed(rows, res.output)
        before = self.snapshot()
        with pytest.raises(RuntimeError, match="without a live admit"):
            self.node.commit(step, res.ctx)  # a second commit: refused, nothing changes
        self.same(before)
        event("launched via node.step")

    def launch(self, pend: Pending, poison=None, fail_after=LAYERS):
        prep = pend.prep
        if poison is not None:
            self.poison, self.fail_after = poison, fail_after
            try:
                with pytest.raises(Boom):
                    self.runner.launch(prep, pend.tokens)
            finally:
                self.poison, self.fail_after = None, LAYERS
            self.failed(pend.rows)
            event("failing forward (runner)")
        else:
            self.landed(pend.rows, self.runner.launch(prep, pend.tokens))
            event("launched via GraphRunner")
        before = self.snapshot()
        with pytest.raises(RuntimeError, match="already launched or discarded"):
            self.runner.launch(prep, pend.tokens)
        with pytest.raises(RuntimeError, match="without a live admit"):
            self.node.commit(prep.step, prep.ctx)
        self.same(before)

    # -- rules ----------------------------------------------------------------------------------
    @initialize(rids=st.lists(st.sampled_from(RIDS), min_size=2, max_size=4, unique=True))
    def start(self, rids):
        for r in rids:
            self.ingest(r)

    @rule(rid=st.sampled_from(RIDS))
    def ingest(self, rid):
        before = (self.mgr.slot_of(rid), self.mgr.length(rid))
        self.node.ingest_request(rid)
        if rid in self.ingested:
            assert (self.mgr.slot_of(rid), self.mgr.length(rid)) == before  # idempotent
            return
        self.ingested.add(rid)
        self.code[rid] = next(self.codes)

    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True),
          lens=st.lists(st.integers(0, MAX_SPAN), min_size=3, max_size=3),
          commits=st.lists(st.sampled_from([True, True, True, False]), min_size=3, max_size=3),
          how=st.sampled_from(["runner", "node", "pending"]),
          fallback=st.sampled_from([False, False, False, True]),
          declare=st.sampled_from([None, None, "exact", "exact", "wrong"]))
    def step(self, rids, lens, commits, how, fallback, declare):
        self.run(self.spec(rids, lens, commits), how, fallback, None if fallback else declare)

    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True))
    def decode(self, rids):
        self.run(self.spec(rids, [1] * 3, [True] * 3), "runner")

    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=2, unique=True),
          lens=st.lists(st.integers(0, MAX_SPAN), min_size=2, max_size=2))
    def prepare_only(self, rids, lens):
        """Prepared and left pending: a later prepare (of other requests) comes before its launch."""
        self.run(self.spec(rids, lens, [True, True]), "pending")

    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True),
          lens=st.lists(st.integers(0, MAX_SPAN), min_size=3, max_size=3),
          commits=st.lists(st.sampled_from([True, True, False]), min_size=3, max_size=3),
          bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
          how=st.sampled_from(["runner", "node"]), fail_after=st.integers(1, LAYERS))
    def failing_forward(self, rids, lens, commits, bad, how, fail_after):
        """The forward ``attend``s with NaN/inf K/V (writing them into the ring), then raises."""
        self.run(self.spec(rids, lens, commits), how, poison=bad, fail_after=fail_after)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 3), fail=st.sampled_from([False, False, True]),
          bad=st.sampled_from([float("nan"), float("inf")]))
    def launch_pending(self, i, fail, bad):
        """Launch a pending step (perhaps not the oldest), or launch it into a failing forward."""
        pend = self.pending.pop(i % len(self.pending))
        stale = any(not self.live(r) for r in pend.rows)
        if stale and any(self.length.get(r, 0) for r in self.slot):
            event("stale launch while other streams hold committed keys")
        event(f"{'failing ' if fail else ''}launch of a {'stale ' if stale else ''}pending step, "
              f"{len(self.pending)} others pending")
        self.launch(pend, bad if fail else None)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 3))
    def discard_pending(self, i):
        self.discard(self.pending.pop(i % len(self.pending)))

    def discard(self, pend: Pending) -> None:
        self.runner.discard(pend.prep)
        self.rolled_back(pend.rows)
        event(f"discarded a {'stale ' if any(not self.live(r) for r in pend.rows) else ''}pending step")
        before = self.snapshot()
        self.runner.discard(pend.prep)  # a second discard does nothing
        with pytest.raises(RuntimeError, match="already launched or discarded"):
            self.runner.launch(pend.prep, pend.tokens)
        self.same(before)

    @precondition(lambda self: self.busy())
    @rule(pick=st.integers(0, 7), others=st.lists(st.sampled_from(RIDS), max_size=2, unique=True),
          how=st.sampled_from(["runner", "node"]))
    def double_admit(self, pick, others, how):
        """A request with a step in flight is admitted again: an error, and nothing changes."""
        busy = sorted(self.busy())
        rid = busy[pick % len(busy)]
        spec = self.spec([o for o in others if o != rid], [1, 1], [True, True], avoid_busy=False) + [(rid, 1, True)]
        self.run(spec, how)

    @precondition(lambda self: self.busy())
    @rule(pick=st.integers(0, 7), how=st.sampled_from(["reset", "reset", "free", "remove"]),
          then=st.sampled_from([None, "launch", "fail", "discard"]))
    def end_in_flight(self, pick, how, then):
        """A request whose step is pending is reset or removed: the step goes stale. ``then``:
        launch it (or fail it, or discard it) right away, or leave it for a later rule."""
        busy = sorted(self.busy())
        rid = busy[pick % len(busy)]
        at = next(i for i, p in enumerate(self.pending) if any(r.rid == rid and self.live(r) for r in p.rows))
        if how == "remove":
            self.remove(rid)
        else:
            self.reset(rid, how == "free")
        if then == "discard":
            self.discard_pending(at)
        elif then is not None:
            self.launch_pending(at, then == "fail", float("nan"))

    @rule(rid=st.sampled_from(RIDS), free=st.booleans())
    def reset(self, rid, free):
        busy = rid in self.busy()
        if busy:
            event(f"reset{' (free)' if free else ''} of a request in flight: its slot is parked")
        self.node.reset_request(rid, free)
        self.taint.pop(rid, None)
        if busy:
            self.park(rid)
        if free:
            self.forget(rid)
        elif busy:  # stays ingested without a slot: a new stream, in a fresh slot at its next admit
            self.code[rid] = next(self.codes)
        elif rid in self.slot:
            self.length[rid] = 0
            self.code[rid] = next(self.codes)

    @rule(rid=st.sampled_from(RIDS))
    def remove(self, rid):
        if rid in self.busy():
            event("remove of a request in flight: its slot is parked")
            self.park(rid)
        self.node.remove_request(rid)
        self.forget(rid)

    def forget(self, rid):
        self.taint.pop(rid, None)
        self.slot.pop(rid, None)
        self.length.pop(rid, None)
        self.code.pop(rid, None)
        self.ingested.discard(rid)

    # -- the model ------------------------------------------------------------------------------
    @invariant()
    def matches_model(self):
        m = self.mgr
        m.post_warmup_validate()  # slot accounting, marks only on held slots, nothing adrift
        assert set(m.requests) == self.ingested
        held = {r: m.slot_of(r) for r in RIDS if m.slot_of(r) is not None}
        assert held == self.slot
        parked = m.parked_slots
        assert sorted((r, s) for (r, _), s in parked.items()) == \
            sorted((r, row.slot) for (r, _), row in self.parked.items())
        assert len(set(held.values()) | set(parked.values())) == len(held) + len(parked)
        assert m.num_free_slots + len(held) + len(parked) == SLOTS
        for r in RIDS:
            assert m.length(r) == self.length.get(r, 0), r
        assert set(m._in_flight) == self.busy()
        streams = [(r, slot, self.length[r], self.code[r]) for r, slot in self.slot.items() if r not in self.taint]
        # (a tainted ring no longer holds what the length says: reset is the way out). A parked
        # slot still holds the stream its stale step was admitted for: only that step writes it.
        streams += [(r, row.slot, row.start, row.code) for (r, _), row in self.parked.items()]
        for r, slot, n, code in streams:
            if not n:
                continue
            pos = retained(n)
            idx = [cache_index(p) for p in pos]
            for layer in range(LAYERS):
                got = m.layer(layer)[slot][:, :, idx]  # [ROWS, H, len(pos), 2D]
                want = values(layer, code, pos)
                assert torch.equal(got[..., D:], want), (r, slot, layer, pos)
                assert torch.equal(got[..., :D], -want - 0.5), (r, slot, layer, pos)

    def teardown(self):
        for p in self.pending:
            self.runner.discard(p.prep)


BoundedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestBoundedMachine = BoundedMachine.TestCase
