"""A hypothesis state machine over a small paged KV manager with the prefix cache on.

Requests start from the cache (``admit_prefix``) with prompts drawn from a few shared prefixes
and random tails, under one of two model identities (two roots); others start plain (no chain).
Rules: start (and prefill it all), chunked prefill, plain prefill, decode steps (committed,
rolled back after writing NaN, or computed without being kept), fork, reset (with and without
free), remove, a reset or remove while a step is in flight, extend_tokens, clear_prefix_cache.
Every step is checked against the pool as it was (refused exactly when it needs more pages than
are free or idle, taking nothing; evicting exactly the oldest idle pages it needs beyond the
free list). A rollback publishes nothing.

Every K/V entry a step writes is a function of (model, token id, position, layer, head, dim), so
after every rule each stream's pages must hold exactly its tokens' K/V, and every published page
(held or idle) exactly the K/V of its key's tokens at its depth under its root's model: a cached
page is never overwritten, reused under another prefix, or found under another root.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mstar_core import KVConfig, KVManager, KVSpan, KVStep, Node, Step, StepContext
from mstar_core.kv.prefix import PrefixCache

RIDS = ("a", "b", "c", "d", "e")
LABEL = "t"
LAYERS, HKV, D = 2, 2, 4
PAGES = {2: 12, 3: 9, 4: 7}  # pages per page size
MODELS = ("model-a", "model-b")
# Shared prompt prefixes: the third begins like the first, then diverges.
PREFIXES = (
    tuple(range(1, 11)),
    tuple(range(21, 31)),
    (1, 2, 3, 4, 45, 46, 47, 48, 49, 50),
)
VOCAB = 60

token = st.integers(1, VOCAB)
fresh_tokens = st.lists(token, min_size=6, max_size=6)


def kv_values(m: int, toks, pos) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, tokens, H_kv, D]`` that model ``m`` writes for ``toks`` at ``pos``
    (exact in float32; the two models write different values for the same tokens)."""
    t = torch.tensor(list(toks), dtype=torch.float32)[None, :, None, None]
    p = torch.tensor(list(pos), dtype=torch.float32)[None, :, None, None]
    layer = torch.arange(LAYERS, dtype=torch.float32)[:, None, None, None]
    h = torch.arange(HKV, dtype=torch.float32)[None, None, :, None] * 0.5
    d = torch.arange(D, dtype=torch.float32)[None, None, None, :] * 0.125
    k = t * 256 + p * 2 + layer + h + d
    if m == 1:
        k = -k
    return k, k * 2 + 1


def pages_for(n: int, ps: int) -> int:
    return -(-n // ps)


@dataclass
class Model:
    """What one stream must hold: ``m`` (the model that writes its K/V: its root), its committed
    tokens, the token ids its chain knows (None: not started from the cache), and how many
    tokens its prefill must reach before it decodes."""

    m: int
    tokens: list[int]
    known: list[int] | None
    prompt: int = 0

    @property
    def ready(self) -> bool:
        return bool(self.tokens) and len(self.tokens) >= self.prompt


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVManager | None = None
        self.model: dict[str, Model] = {}  # rid -> its "t" stream (present iff the manager has one)
        self.ingested: set[str] = set()
        self.nodes: dict[int, tuple[int, int]] = {}  # published node id -> (model, depth)

    # -- set-up -----------------------------------------------------------------------------------
    @initialize(ps=st.sampled_from(sorted(PAGES)))
    def build(self, ps):
        self.ps = ps
        cfg = KVConfig(LAYERS, HKV, D, ps, PAGES[ps], HKV)
        self.kv = KVManager(cfg, "cpu", torch.float32, prefix_cache=True)
        self.node = Node([self.kv])
        self.roots = tuple(self.node.prefix_root(m) for m in MODELS)
        assert self.roots[0] != self.roots[1]
        assert isinstance(self.kv.pool, PrefixCache)
        self.pool: PrefixCache = self.kv.pool

    # -- helpers ----------------------------------------------------------------------------------
    def ingest(self, rid):
        self.node.ingest_request(rid)
        self.ingested.add(rid)

    def root_ids(self) -> dict[int, int]:
        """The cache's node id of each model's root (those made so far) -> the model."""
        fp = self.kv.fingerprint()
        got = {}
        for m, root in enumerate(self.roots):
            i = self.pool._roots.get((fp, root, LABEL))
            if i is not None:
                got[i] = m
        return got

    def scan_published(self):
        """Learn (model, depth) of every page published since the last scan, from its parent."""
        roots = self.root_ids()
        for e in sorted(self.pool._by_page.values(), key=lambda e: e.node):
            if e.node in self.nodes:
                continue
            parent = e.key[0]
            if parent in roots:
                self.nodes[e.node] = (roots[parent], 0)
            else:
                assert parent in self.nodes, f"page {e.page} published under an unknown node {parent}"
                m, depth = self.nodes[parent]
                self.nodes[e.node] = (m, depth + 1)

    def snapshot(self):
        p = self.pool
        s = p.stats
        return (list(p._free), list(p._idle), dict(p._refs), p.cached, s.published, s.evicted,
                {k: (list(v.pages), v.length) for k, v in self.kv.streams.items()})

    def stream_model(self, rid) -> Model:
        """``rid``'s stream, or the plain one (model 0 writes it) a step would create."""
        return self.model.get(rid) or Model(0, [], None)

    def tokens_for(self, rid, n, fresh):
        """The next ``n`` token ids of ``rid``: what its chain knows, then fresh ones."""
        md = self.stream_model(rid)
        at = len(md.tokens)
        ahead = [] if md.known is None else md.known[at: at + n]
        return ahead + [fresh[i % len(fresh)] for i in range(n - len(ahead))]

    def run_step(self, spans, fresh, fail=False):
        """One step over ``spans`` (rid, n, commit) as the model predicts it: refused (nothing
        taken) iff it needs more pages than are free or idle; admitted, evicting exactly the
        oldest idle pages it needs beyond the free list; K/V written in plan order; then committed,
        or (``fail``) NaN written and rolled back, publishing nothing. Returns whether it ran."""
        ps, pool = self.ps, self.pool
        need = 0
        toks = {}
        for rid, n, _ in spans:
            have = len(self.stream_model(rid).tokens)
            need += pages_for(have + n, ps) - pages_for(have, ps)
            toks[rid] = self.tokens_for(rid, n, fresh)
        before = self.snapshot()
        free_list, idle = before[0], before[1]
        fits = need <= len(free_list) + len(idle)
        assert self.kv.num_free_pages == len(free_list) + len(idle)
        step = Step(KVStep(tuple(KVSpan(rid, LABEL, n, commit) for rid, n, commit in spans)))
        ctx = StepContext()
        out = self.node.admit(step, ctx)
        assert bool(out) == fits, (need, len(free_list), len(idle), out)
        if not out:
            assert self.snapshot() == before, "a refused step changed the pool"
            event("step refused for pages")
            return False
        short = max(0, need - len(free_list))
        evicted = idle[:short]
        assert pool.stats.evicted - before[5] == short
        assert not set(evicted) & (set(pool._idle) | set(pool._by_page)), "not the oldest idle pages evicted"
        assert list(pool._idle) == idle[short:]
        if short:
            event("a step evicted cached pages")
        self.node.plan(step, ctx)
        lay = ctx.plan_results["kv"].layout(LABEL)
        total = sum(n for _, n, _ in spans)
        ks = torch.empty(LAYERS, total, HKV, D)
        vs = torch.empty(LAYERS, total, HKV, D)
        positions = torch.empty(total, dtype=torch.int64)
        for (rid, n, _), sl in zip(spans, lay.spans, strict=True):
            assert (sl.request_id, sl.to_compute) == (rid, n)
            at = sl.length - n
            pos = range(at, at + n)
            k, v = kv_values(self.stream_model(rid).m, toks[rid], pos)
            ks[:, sl.q_start: sl.q_start + n] = k
            vs[:, sl.q_start: sl.q_start + n] = v
            positions[sl.q_start: sl.q_start + n] = torch.tensor(list(pos))
        assert torch.equal(lay.positions.to(torch.int64)[:total], positions)
        if fail:
            ks.fill_(float("nan"))
            vs.fill_(float("nan"))
        for layer in range(LAYERS):
            self.kv.write_kv(ks[layer], vs[layer], layer, LABEL)
        if fail:
            cached, published = pool.cached, pool.stats.published
            self.node.rollback_admit(step, ctx)
            assert (pool.cached, pool.stats.published) == (cached, published), "a rolled-back step published"
            event("step rolled back")
            return True
        self.node.commit(step, ctx)
        if pool.stats.published > before[4]:
            event("a commit published pages")
        for rid, _, commit in spans:
            md = self.model.setdefault(rid, self.stream_model(rid))
            if commit:
                md.tokens += toks[rid]
        return True

    # -- rules ------------------------------------------------------------------------------------
    @rule(rid=st.sampled_from(RIDS), m=st.sampled_from([0, 0, 1]), which=st.integers(0, len(PREFIXES) - 1),
          k=st.integers(0, 10), tail=st.lists(token, max_size=4), prefill=st.sampled_from([True, True, False]),
          replace=st.sampled_from([True, True, False]))
    def start(self, rid, m, which, k, tail, prefill, replace):
        """admit_prefix a request (``replace``: after removing the one under that id, whose
        published pages go idle), then (maybe) prefill what was not found cached."""
        prompt = list(PREFIXES[which][:k]) + tail
        if not prompt:
            return
        if replace:
            self.remove(rid)
        self.ingest(rid)
        md = self.model.get(rid)
        stats = (self.pool.stats.lookups, self.pool.stats.hit_tokens)
        if md is not None and (md.tokens or md.known is not None):
            with pytest.raises(RuntimeError, match="starts from the cache once"):
                self.kv.admit_prefix(rid, LABEL, prompt, self.roots[m])
            assert (self.pool.stats.lookups, self.pool.stats.hit_tokens) == stats
            return
        ps = self.ps
        most = (len(prompt) - 1) // ps
        # A lower bound: the leading pages of a live stream of the same model, published and
        # keyed, that hold this prompt's first pages.
        least = 0
        for other in self.model:
            o = self.model[other]
            if o.known is None or o.m != m:
                continue
            s = self.kv.stream(other, LABEL)
            i = 0
            while (i < min(most, s.chain.keyed) and s.pages[i] in self.pool._by_page
                   and o.known[i * ps:(i + 1) * ps] == prompt[i * ps:(i + 1) * ps]):
                i += 1
            least = max(least, i)
        match = self.kv.match_prefix(prompt, self.roots[m], LABEL)
        out = self.kv.admit_prefix(rid, LABEL, prompt, self.roots[m])
        assert out and out.cached_tokens == match
        got = out.cached_tokens
        assert got % ps == 0 and got <= len(prompt) - 1
        assert got >= least * ps, (got, least, prompt)
        assert self.pool.stats.lookups == stats[0] + 1 and self.pool.stats.hit_tokens == stats[1] + got
        if got:
            event("prefix hit")
        self.model[rid] = Model(m, prompt[:got], list(prompt), len(prompt))
        if prefill:
            self.run_step([(rid, len(prompt) - got, True)], [1])

    @precondition(lambda self: any(not md.ready and md.known is not None for md in self.model.values()))
    @rule(i=st.integers(0, 9), chunk=st.integers(1, 8), fail=st.booleans())
    def prefill(self, i, chunk, fail):
        """A chunk of a started request's prompt (committed, or rolled back)."""
        todo = sorted(r for r, md in self.model.items() if not md.ready and md.known is not None)
        rid = todo[i % len(todo)]
        md = self.model[rid]
        self.run_step([(rid, min(chunk, md.prompt - len(md.tokens)), True)], [1], fail=fail)

    @rule(rid=st.sampled_from(RIDS), prompt=st.lists(token, min_size=1, max_size=9))
    def plain(self, rid, prompt):
        """A request that never gives its tokens: private pages, never published."""
        md = self.model.get(rid)
        if md is not None and (md.tokens or md.known is not None):
            return
        self.ingest(rid)
        self.run_step([(rid, len(prompt), True)], prompt)

    @precondition(lambda self: any(md.ready for md in self.model.values()))
    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True), n=st.integers(1, 3),
          mode=st.sampled_from(["commit", "commit", "rollback", "not kept"]), fresh=fresh_tokens)
    def decode(self, rids, n, mode, fresh):
        picked = [r for r in rids if r in self.model and self.model[r].ready]
        if not picked:
            return
        self.run_step([(r, n, mode != "not kept") for r in picked], fresh, fail=mode == "rollback")

    @rule(src=st.sampled_from(RIDS), dst=st.sampled_from(RIDS), replace=st.sampled_from([True, True, False]))
    def fork(self, src, dst, replace):
        """fork ``src`` into ``dst`` (``replace``: after removing ``dst``)."""
        if src == dst or src not in self.model or not self.model[src].tokens:
            return
        if replace:
            self.remove(dst)
        self.ingest(dst)
        if dst in self.model:
            with pytest.raises(ValueError, match="already has a 't' stream"):
                self.kv.fork(src, dst, LABEL)
            return
        s = self.kv.stream(src, LABEL)
        ps, length = self.ps, s.length
        full = s.pages[: length // ps]
        k = pages_for(length, ps) - len(full)  # the partial page, copied
        before = self.snapshot()
        refs = {p: self.pool._refs.get(p, 1) for p in full}
        out = self.kv.fork(src, dst, LABEL)
        assert bool(out) == (k <= len(before[0]) + len(before[1]))
        if not out:
            assert self.snapshot() == before
            return
        d = self.kv.stream(dst, LABEL)
        assert d.pages[: len(full)] == full and not set(d.pages[len(full):]) & set(s.pages)
        assert all(self.pool._refs[p] == refs[p] + 1 for p in full), "a fork's full pages are shared"
        src_md = self.model[src]
        known = None if src_md.known is None else src_md.known[: len(src_md.tokens)]
        self.model[dst] = Model(src_md.m, list(src_md.tokens), known, 0)
        event("forked")

    @rule(rid=st.sampled_from(RIDS), free=st.booleans())
    def reset(self, rid, free):
        self.node.reset_request(rid, free)
        if free:
            self.ingested.discard(rid)
            self.model.pop(rid, None)
        elif rid in self.model:
            self.model[rid] = Model(0, [], None)  # an empty stream, no chain

    @rule(rid=st.sampled_from(RIDS))
    def remove(self, rid):
        self.node.remove_request(rid)
        self.ingested.discard(rid)
        self.model.pop(rid, None)

    @precondition(lambda self: any(md.ready for md in self.model.values()))
    @rule(rids=st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True), victim=st.integers(0, 2),
          how=st.sampled_from(["reset", "reset free", "remove"]), land=st.sampled_from(["commit", "rollback"]),
          fresh=fresh_tokens)
    def drop_in_flight(self, rids, victim, how, land, fresh):
        """A request reset or removed while its step is in flight: its pages (shared ones too)
        stay held until the step lands, then the other spans commit or roll back as usual."""
        picked = [r for r in rids if r in self.model and self.model[r].ready]
        if not picked:
            return
        rid = picked[victim % len(picked)]
        spans = [(r, 1, True) for r in picked]
        step = Step(KVStep(tuple(KVSpan(r, LABEL, 1) for r in picked)))
        ctx = StepContext()
        if not self.node.admit(step, ctx):
            return
        self.node.plan(step, ctx)
        lay = ctx.plan_results["kv"].layout(LABEL)
        toks = {r: self.tokens_for(r, 1, fresh) for r, _, _ in spans}
        ks = torch.empty(LAYERS, len(picked), HKV, D)
        vs = torch.empty_like(ks)
        for sl in lay.spans:
            md = self.model[sl.request_id]
            k, v = kv_values(md.m, toks[sl.request_id], [sl.length - 1])
            ks[:, sl.q_start: sl.q_start + 1], vs[:, sl.q_start: sl.q_start + 1] = k, v
        for layer in range(LAYERS):
            self.kv.write_kv(ks[layer], vs[layer], layer, LABEL)
        old = self.kv.stream(rid, LABEL)
        held = list(old.pages)
        refs = {p: self.pool._refs.get(p, 1) for p in held}
        if how == "remove":
            self.node.remove_request(rid)
        else:
            self.node.reset_request(rid, free=how == "reset free")
        # parked: held as before, none free or idle
        assert {p: self.pool._refs.get(p, 1) for p in held} == refs
        assert not set(held) & (set(self.pool._free) | set(self.pool._idle))
        self.kv.post_warmup_validate()
        if land == "commit":
            self.node.commit(step, ctx)
            for r in picked:
                if r != rid:
                    self.model[r].tokens += toks[r]
        else:
            self.node.rollback_admit(step, ctx)
        # landed: each page's reference went back (the last one's to the idle list or the free one)
        assert not self.kv._parked
        for p in held:
            if refs[p] > 1:
                assert self.pool._refs.get(p, 1) == refs[p] - 1, p
            else:
                assert p in (self.pool._idle if p in self.pool._by_page else self.pool._free), p
        if how == "reset":
            self.model[rid] = Model(0, [], None)
        else:
            self.model.pop(rid)
            self.ingested.discard(rid)
        event("a step landed after its request was dropped")

    @precondition(lambda self: any(md.known is not None for md in self.model.values()))
    @rule(i=st.integers(0, 9), ahead=st.lists(token, max_size=3))
    def extend(self, i, ahead):
        """extend_tokens with the committed tokens the chain does not know, and a few to come."""
        have = sorted(r for r, md in self.model.items() if md.known is not None)
        behind = [r for r in have if len(self.model[r].known) < len(self.model[r].tokens)]
        have = behind or have
        rid = have[i % len(have)]
        md = self.model[rid]
        more = md.tokens[len(md.known):] + ahead
        published = self.pool.stats.published
        self.kv.extend_tokens(rid, LABEL, more)
        md.known += more
        ch = self.kv.stream(rid, LABEL).chain
        assert ch.keyed == min(len(md.tokens), len(md.known)) // self.ps
        assert self.pool.stats.published >= published
        if self.pool.stats.published > published:
            event("extend_tokens published pages")

    @rule()
    def clear(self):
        idle = list(self.pool._idle)
        cached = self.pool.cached
        assert self.kv.clear_prefix_cache() == len(idle)
        assert self.pool.idle == 0 and self.pool.cached == cached - len(idle)
        assert set(idle) <= set(self.pool._free)

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def accounting(self):
        kv, pool, ps = self.kv, self.pool, self.ps
        kv.post_warmup_validate()
        assert not kv._parked  # every step here landed
        held = [p for s in kv.streams.values() for p in s.pages]
        assert not set(held) & set(pool._free), "a page is free while a stream holds it"
        assert not set(held) & set(pool._idle), "a page is idle while a stream holds it"
        assert len(set(held)) + len(pool._idle) + len(pool._free) == pool.num_pages
        assert {k[0] for k in kv.streams} == set(self.model)
        for rid, md in self.model.items():
            s = kv.stream(rid, LABEL)
            assert s.length == len(md.tokens) and len(s.pages) == pages_for(s.length, ps), rid
            assert not s.in_flight
            if md.known is None:
                assert s.chain is None
                assert not set(s.pages) & set(pool._by_page), "a plain stream holds a published page"
            else:
                assert s.chain is not None and s.chain.tokens == md.known, rid
                # every committed full page the chain knows is keyed (published at commit)
                assert s.chain.keyed == min(s.length, len(md.known)) // ps, rid
                assert md.known[: s.length] == md.tokens[: len(md.known)], rid

    @invariant()
    def contents(self):
        """Each stream's pages hold its tokens' K/V; each published page its key's, under its root."""
        kv, pool, ps = self.kv, self.pool, self.ps
        store = kv.storage
        self.scan_published()
        for rid, md in self.model.items():
            s = kv.stream(rid, LABEL)
            n = len(md.tokens)
            if not n:
                continue
            pos = torch.arange(n)
            pg = torch.tensor(s.pages)[pos // ps]
            k, v = kv_values(md.m, md.tokens, range(n))
            assert torch.equal(store[:, pg, 0, pos % ps], k), f"{rid}: K differs from its tokens'"
            assert torch.equal(store[:, pg, 1, pos % ps], v), f"{rid}: V differs from its tokens'"
            for i, p in enumerate(s.pages):
                e = pool._by_page.get(p)
                if e is not None:
                    # found or published under this stream's root, at this depth
                    assert self.nodes[e.node] == (md.m, i), (rid, i, p, self.nodes[e.node])
                    assert list(e.key[1]) == md.tokens[i * ps:(i + 1) * ps]
        for p, e in pool._by_page.items():
            m, depth = self.nodes[e.node]
            toks = e.key[1]
            assert len(toks) == ps
            k, v = kv_values(m, toks, range(depth * ps, depth * ps + ps))
            assert torch.equal(store[:, p, 0], k) and torch.equal(store[:, p, 1], v), f"cached page {p} overwritten"


PrefixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestPrefixMachine = PrefixMachine.TestCase

