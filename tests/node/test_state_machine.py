"""A hypothesis state machine over the paged KV manager and paged attention, driven through
``Node`` and ``GraphRunner`` (graphs on: decode steps replay their captured closures).

Operations: ingest, steps through the runner (launched at once, or prepared and left pending so
that a second prepare comes before the first launch), launch or discard of a pending step, a
``node.step``, a forward that writes NaN/inf K/V and then raises, reset, remove, fork, a double
commit. After every operation the managers are checked against a model: the pages in use, the
streams' lengths, nothing in flight but pending steps, and every committed K/V entry.

The forward writes V = 1000 * code + position (``code`` identifies the request that wrote the
token) and K = Q = 0, so every query's attention output is the mean of the V it may see: the
model predicts it exactly, and any K/V that crossed requests, or a NaN, shows.
"""

import math

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
    GraphRunner,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
)
from mstar_core.capabilities import paged_step_capability

from ..helpers import REF_WRAPPERS

RIDS = ("a", "b", "c", "d")
FORKS = ("e", "f")  # fork destinations (ingested by the fork rule), then ordinary requests
CODE = {r: i + 1 for i, r in enumerate(RIDS + FORKS)}
PS, PAGES, HQ, HKV, D = 2, 14, 2, 1, 2


class Boom(Exception):
    """The forward's planted failure."""


class PagedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        cfg = KVConfig(1, HKV, D, PS, PAGES, HQ)
        self.kv = KVManager(cfg, "cpu", torch.float64)
        self.attn = PagedAttentionManager(self.kv, "cpu", torch.float64, cfg, REF_WRAPPERS, accelerator_graph=True)
        self.node = Node([self.kv, self.attn])
        self.runner = GraphRunner(self.node, self.forward, buckets=[1, 2, 4], device="cpu", slots=2)
        self.runner.warmup()
        self.poison: float | None = None  # the forward writes this into K/V and raises
        self.ingested: set[str] = set()
        self.codes: dict[str, list[int]] = {}  # committed stream "text" of each request: code per position
        self.pending: list = []  # prepared, neither launched nor discarded
        # Eager plans, in order: (kind, wrapper slot). Eager steps rotate over two wrapper slots
        # per kind; a pending eager step whose (kind, slot) was planned again is refused at launch.
        self.eager: list[tuple[str, int]] = []
        self.planned_at: dict[int, int] = {}  # id(pending eager step) -> its index in self.eager
        # A pending step's view at prepare (its requests' committed codes), the requests reset or
        # removed since (their spans go stale: dropped at commit), and the pages their old streams
        # hold, parked until the step lands.
        self.snap: dict[int, dict[str, list[int]]] = {}
        self.stale: dict[int, set[str]] = {}
        self.parked: dict[int, int] = {}

    # -- the forward ----------------------------------------------------------------------------
    def forward(self, ctx, tokens):
        lay = ctx.plan_results["kv"].layout("text")
        pos = lay.positions[: tokens.numel()].to(torch.float64)
        v = (tokens.to(torch.float64) * 1000 + pos)[:, None, None].expand(-1, HKV, D).contiguous()
        k = torch.zeros_like(v)
        if self.poison is not None:
            self.kv.write_kv(k + self.poison, v + self.poison, layer_idx=0, label="text")
            raise Boom("planted")
        self.kv.write_kv(k, v, layer_idx=0, label="text")
        return self.attn.run(torch.zeros(tokens.numel(), HQ, D, dtype=torch.float64), "text", layer_idx=0)[:, 0, 0]

    # -- helpers --------------------------------------------------------------------------------
    def busy(self) -> set[str]:
        """Requests with a live step in flight (a reset or remove makes a pending step's span stale)."""
        return {s.request_id for p in self.pending for s in p.step.kv.spans
                if s.request_id not in self.stale.get(id(p), ())}

    def make_step(self, rids, lens):
        free = sorted(self.ingested - self.busy())
        picked = [r for r in rids if r in free]
        if not picked:
            return None
        return Step(KVStep(tuple(KVSpan(r, "text", n) for r, n in zip(picked, lens, strict=False))))

    def tokens(self, step):
        return torch.tensor([CODE[s.request_id] for s in step.kv.spans for _ in range(s.num_tokens)])

    def expect(self, step, out, seen=None):
        """Each query's output is the mean of 1000 * code + position over the keys it sees
        (``seen``: the committed codes the step was planned over; default: the current ones)."""
        seen = self.codes if seen is None else seen
        i = 0
        for s in step.kv.spans:
            codes = seen.get(s.request_id, []) + [CODE[s.request_id]] * s.num_tokens
            base = len(codes) - s.num_tokens
            for t in range(s.num_tokens):
                p = base + t
                want = sum(1000 * c + j for j, c in enumerate(codes[: p + 1])) / (p + 1)
                assert math.isclose(float(out[i]), want, rel_tol=1e-12), (s, t, float(out[i]), want)
                i += 1

    def landed(self, step, out, prep=None):
        """The step committed: its live spans advance; a stale span (its request reset or removed
        while the step was pending) computed over the old stream's parked pages and is dropped."""
        key = id(prep)
        self.expect(step, out, self.snap.get(key))
        stale = self.stale.get(key, set())
        for s in step.kv.spans:
            if s.request_id not in stale:
                self.codes[s.request_id] = self.codes.get(s.request_id, []) + [CODE[s.request_id]] * s.num_tokens
        if stale:
            event("stale pending step landed")

    def forget(self, prep):
        for d in (self.snap, self.stale, self.parked, self.planned_at):
            d.pop(id(prep), None)

    def pages_needed(self, step, codes=None):
        codes = self.codes if codes is None else codes
        def held(s):
            return len(codes.get(s.request_id, []))

        return sum(max(0, -(-(held(s) + s.num_tokens) // PS) - -(-held(s) // PS)) for s in step.kv.spans)

    @staticmethod
    def is_graph(step):
        return all(s.num_tokens == 1 for s in step.kv.spans)

    def slot_busy(self, step):
        """A graph step whose staging slot still holds a pending step: prepare refuses it."""
        held = {p.ctx.slot for p in self.pending if p.graph is not None}
        return self.is_graph(step) and self.runner._next_slot in held

    def planned(self, step):
        """Record an eager plan (an admitted step that is not a graph step)."""
        if not self.is_graph(step):
            self.eager.append((paged_step_capability(tuple(s.num_tokens for s in step.kv.spans)), len(self.eager) % 2))
        return len(self.eager) - 1

    def prepare(self, step):
        """prepare as the model predicts it: refused before admit, refused for pages, or planned."""
        if self.slot_busy(step):
            with pytest.raises(RuntimeError, match="still holds a prepared step"):
                self.runner.prepare(step)
            event("prepare refused: slot pending")
            return None
        fits = self.pages_needed(step) <= self.kv.num_free_pages
        prep = self.runner.prepare(step)
        assert bool(prep.outcome) == fits, prep.outcome.reason()
        if not fits:
            return None
        assert (prep.graph is not None) == self.is_graph(step)
        self.planned_at[id(prep)] = self.planned(step)
        self.snap[id(prep)] = {r: list(self.codes.get(r, [])) for r in step.kv.request_ids}
        return prep

    def run_now(self, step):
        prep = self.prepare(step)
        if prep is not None:
            self.launch(prep)

    def launch(self, prep):
        at = self.planned_at[id(prep)]
        if prep.graph is None and self.eager[at] in self.eager[at + 1:]:
            with pytest.raises(RuntimeError, match="re-planned by a later step"):
                self.runner.launch(prep, self.tokens(prep.step))
            event("launch refused: wrapper re-planned")
            self.forget(prep)
            return  # rolled back: nothing landed
        self.landed(prep.step, self.runner.launch(prep, self.tokens(prep.step)), prep)
        self.forget(prep)
        event(f"launched {'graph' if prep.graph is not None else 'eager'} step, {len(self.pending)} still pending")

    # -- rules ----------------------------------------------------------------------------------
    @initialize(rids=st.lists(st.sampled_from(RIDS), min_size=2, max_size=4, unique=True))
    def start(self, rids):
        for r in rids:
            self.ingest(r)

    @rule(rid=st.sampled_from(RIDS))
    def ingest(self, rid):
        self.node.ingest_request(rid)
        self.ingested.add(rid)

    @rule(rids=st.lists(st.sampled_from(RIDS + FORKS), min_size=1, max_size=4, unique=True),
          lens=st.lists(st.integers(0, 5), min_size=4, max_size=4))
    def step_any(self, rids, lens):
        step = self.make_step(rids, lens)
        if step is not None:
            self.run_now(step)

    @rule(rids=st.lists(st.sampled_from(RIDS + FORKS), min_size=1, max_size=4, unique=True))
    def decode(self, rids):
        step = self.make_step(rids, [1] * 4)
        if step is not None:
            self.run_now(step)

    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=2, unique=True), graph=st.booleans())
    def prepare_only(self, rids, graph):
        """A second prepare before the first launch: both steps must run through their own plans."""
        step = self.make_step(rids, [1 if graph else 3] * 2)
        if step is not None and (prep := self.prepare(step)) is not None:
            self.pending.append(prep)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 3), launch=st.booleans())
    def finish_pending(self, i, launch):
        prep = self.pending.pop(i % len(self.pending))
        if launch:
            self.launch(prep)
        else:
            self.forget(prep)
            self.runner.discard(prep)

    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True),
          lens=st.lists(st.integers(1, 4), min_size=4, max_size=4),
          bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    def failing_forward(self, rids, lens, bad):
        """The forward writes NaN/inf K/V into the step's (fresh) pages, then raises: the step is
        rolled back and no later step of any request sees the bad values."""
        step = self.make_step(rids, lens)
        if step is None or self.pages_needed(step) > self.kv.num_free_pages or self.slot_busy(step):
            return
        self.planned(step)
        event("failing forward")
        self.poison = bad
        try:
            with pytest.raises(Boom):
                self.runner.step(step, self.tokens(step))
        finally:
            self.poison = None

    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True),
          lens=st.lists(st.integers(0, 3), min_size=4, max_size=4))
    def node_step_and_double_commit(self, rids, lens):
        step = self.make_step(rids, lens)
        if step is None:
            return
        fits = self.pages_needed(step) <= self.kv.num_free_pages
        res = self.node.step(step, lambda ctx: self.forward(ctx, self.tokens(step)))
        assert bool(res.outcome) == fits
        if fits:
            if not self.is_graph(step):
                self.planned(step)
            else:  # node.step plans eagerly whatever the step's shape
                self.eager.append(("paged_decode", len(self.eager) % 2))
            self.landed(step, res.output)
            with pytest.raises(RuntimeError, match="no live admit"):
                self.node.commit(step, res.ctx)

    def drop(self, rid):
        """``rid``'s stream is reset or removed. A pending step on it goes stale: the old stream's
        pages stay parked (its forward may still write them) until that step lands."""
        for p in self.pending:
            if rid in p.step.kv.request_ids and rid not in self.stale.get(id(p), set()):
                self.stale.setdefault(id(p), set()).add(rid)
                self.parked[id(p)] = self.parked.get(id(p), 0) + -(-len(self.codes.get(rid, [])) // PS)
                event("reset or remove of a request with a step pending")
        self.codes.pop(rid, None)

    @rule(rid=st.sampled_from(RIDS + FORKS), free=st.booleans())
    def reset(self, rid, free):
        self.node.reset_request(rid, free)
        self.drop(rid)
        if free:
            self.ingested.discard(rid)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 3), remove=st.booleans())
    def drop_pending_request(self, i, remove):
        """Reset or remove a request whose step is prepared and not launched."""
        rid = self.pending[i % len(self.pending)].step.kv.request_ids[0]
        if remove:
            self.remove(rid)
        else:
            self.reset(rid, free=False)

    @rule(rid=st.sampled_from(RIDS + FORKS))
    def remove(self, rid):
        self.node.remove_request(rid)
        self.drop(rid)
        self.ingested.discard(rid)

    @rule(src=st.sampled_from(RIDS), dst=st.sampled_from(FORKS))
    def fork(self, src, dst):
        self.ingest(dst)
        if src == dst or src not in self.codes or dst not in self.ingested or dst in self.codes or dst in self.busy():
            return
        if (dst, "text") in self.kv.streams:
            with pytest.raises(ValueError, match="already has a 'text' stream"):
                self.kv.fork(src, dst, "text")
            return
        fits = -(-len(self.codes[src]) // PS) <= self.kv.num_free_pages
        out = self.kv.fork(src, dst, "text")
        assert bool(out) == fits
        if out:
            event("forked")
            self.codes[dst] = list(self.codes[src])

    # -- the model ------------------------------------------------------------------------------
    @invariant()
    def matches_model(self):
        kv = self.kv
        kv.post_warmup_validate()  # page accounting: every page owned once, free + used = all
        held = {(s.request_id, s.label) for p in self.pending for s in p.step.kv.spans
                if s.request_id not in self.stale.get(id(p), ())}
        for key, stream in kv.streams.items():
            assert stream.in_flight == (key in held), key
            assert stream.length == len(self.codes.get(key[0], [])), key
        assert {k[0] for k, s in kv.streams.items() if s.length} == {r for r, c in self.codes.items() if c}
        pending_pages = sum(len(p.ctx.admitted["kv"].taken.get(k, [])) for p in self.pending for k in
                            p.ctx.admitted["kv"].taken)
        committed = sum(-(-len(c) // PS) for c in self.codes.values())
        parked = sum(self.parked.values())
        assert kv.num_free_pages == PAGES - 1 - committed - pending_pages - parked  # 1: the graphs' sink page
        layer = kv.layer_view(0)
        for rid, codes in self.codes.items():
            if not codes:
                continue
            s = kv.stream(rid, "text")
            pos = torch.arange(len(codes))
            pages = torch.tensor(s.pages)[pos // PS]
            got_v = layer[pages, 1, pos % PS][:, 0, 0]
            got_k = layer[pages, 0, pos % PS]
            want = torch.tensor([1000.0 * c + j for j, c in enumerate(codes)], dtype=torch.float64)
            assert torch.equal(got_v, want), rid
            assert torch.equal(got_k, torch.zeros_like(got_k)), rid

    def teardown(self):
        for p in self.pending:
            self.runner.discard(p)
        # every parked page went back when its step landed
        self.pending, self.parked = [], {}
        self.matches_model()


PagedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestPagedMachine = PagedMachine.TestCase
