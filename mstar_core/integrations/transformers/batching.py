"""Generation with continuous batching over an :class:`.engine.Engine`: greedy, or drawn per
request by the engine's sampler (:mod:`mstar_core.sampling`) inside each step.

Requests join at their arrival step and leave when done; a prompt waits while the pages it will
need (prompt + new tokens) are not free, or while the step's prompt-token budget is spent. Each
step packs every running request's next token and the joining prompts into one forward.

With the engine's prefix cache a joining prompt starts from the cached pages its tokens begin
with and computes only the rest; one whose prefix another prompt of the same step is about to
compute waits a step for it when that saves at least half of its own prefill. A request that
leaves gives its generated tokens to the cache, so a prompt that repeats them finds them.

On CUDA the host never waits for a step before launching the next: the next step's input tokens
are gathered on the device from the previous step's tokens, and a step's token ids are read (the
only synchronisation) after the following step is launched. So with graphs the host plans step
N+1 while step N runs. The one cost: an end-of-sequence token (or a stop) is seen a step late,
and the token its request computed meanwhile is dropped. Elsewhere a step has run when its launch
returns, so its tokens are read at once.

Under tensor parallelism every rank runs this same loop over the same requests: the logits are
whole on every rank after the model's last collective, so the tokens, and with them every
admission, agree by construction (the request seeds are rank 0's). The ranks check it at every
step whose rows change, before its first collective, and the tokens' checksum at the end. A rank
whose peer failed gets a :class:`~mstar_core.errors.TensorParallelError` from the collective
that noticed, or ends itself when no step makes progress for the engine's ``tp_timeout_s``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mstar_core.capabilities import STEP_KINDS, paged_step_capability
from mstar_core.distributed import is_collective_failure, peer_failed, stall_guard
from mstar_core.errors import InputError, StateError
from mstar_core.integrations.transformers.engine import LABEL, Engine
from mstar_core.integrations.transformers.generation import Generation, StepRecord
from mstar_core.integrations.transformers.prompts import (
    check_arrivals,
    check_eos,
    check_length,
    check_max_new,
    check_on_step,
    check_prompts,
    check_stop,
)
from mstar_core.kv.paged import pages_for
from mstar_core.sampling import SamplingParams, check_sampling, request_seed
from mstar_core.step import KVSpan, KVStep, Step

log = logging.getLogger(__name__)


@dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new: int
    arrives: int
    pages: int  # what it holds at most: prompt + new tokens
    params: SamplingParams
    seed: int
    slot: int | None = None  # its sampler slot, from joining to leaving
    launched: int = 0  # tokens whose step was launched
    generated: list[int] = field(default_factory=list)
    stopped: bool = False  # produced an end-of-sequence token
    joined_at: float = 0.0
    first_token_s: float | None = None
    cached: int = 0  # its prompt's leading tokens found in the prefix cache

    @property
    def to_prefill(self) -> int:
        return len(self.prompt) - self.cached

    @property
    def rid(self) -> str:
        return f"hf{self.index}"

    @property
    def running(self) -> bool:
        """Still has tokens to launch."""
        return not self.stopped and self.launched < self.max_new


class _Launched(NamedTuple):
    """A launched step whose token ids the host has not read yet."""

    rows: list[_Request]
    toks: torch.Tensor  # [rows] next tokens, on the device
    host: torch.Tensor  # the same ids, copied to (pinned) host memory as soon as they are drawn
    ready: torch.cuda.Event | None  # recorded after that copy, timed (None off CUDA)
    done_s: float  # off CUDA: when the step had run (from the start of the run); on CUDA, from ``ready``
    kind: str
    graph: bool
    tokens: int


Stop = Callable[[int, list[int]], bool]


def _digest(value: object) -> int:
    """A hash of ``value``'s repr that fits an int64, the same in every process (what the ranks
    compare; Python's own ``hash`` of a string differs per process)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


def run(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
        arrivals: Sequence[int] | None = None, eos_token_id: int | Sequence[int] | None = None,
        on_step: Callable[[int, int], None] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None, stop: Stop | None = None) -> Generation:
    """Generate ``max_new_tokens`` tokens per prompt (fewer where an end-of-sequence token or a
    stop comes first): greedy, or drawn with ``sampling`` (one :class:`SamplingParams` for all,
    or one per prompt; the engine needs a sampler for it: ``EngineOptions(sampler=...)``).
    ``arrivals[i]``: the step at which prompt ``i`` joins (default all at step 0).
    ``on_step(done, total)`` is called after each step with the tokens produced so far;
    ``stop(i, ids)`` after each new token of prompt ``i`` (``ids``: its new tokens so far, the
    run's own list: read it, never change it), True ending that request there. Whatever happens,
    every request is removed from the engine's resources on return."""
    engine.check_open()
    vocab = getattr(engine.model.config, "vocab_size", None)
    check_max_new(max_new_tokens)
    prompts = check_prompts(prompts, vocab)
    check_length(prompts, max_new_tokens, engine.model.config)
    check_on_step(on_step)
    check_stop(stop)
    return run_checked(engine, prompts, max_new_tokens, check_arrivals(arrivals, len(prompts)),
                       check_eos(eos_token_id, vocab), on_step, check_sampling(sampling, len(prompts)), stop)


def run_checked(engine: Engine, prompts: list[list[int]], max_new_tokens: int, arrivals: list[int], eos: set[int],
                on_step: Callable[[int, int], None] | None, sampling: list[SamplingParams] | None = None,
                stop: Stop | None = None) -> Generation:
    """:func:`run` for inputs already checked where they entered (``check_prompts``,
    ``check_length``, ``check_max_new``, ``check_arrivals``, ``check_eos``, ``check_on_step``,
    ``check_sampling``, ``check_stop``): ``generate`` checks them before it builds the engine."""
    engine.check_open()
    o, ps = engine.options, engine.options.page_size
    params = sampling or [SamplingParams()] * len(prompts)
    if engine.sampler is None:
        drawn = [i for i, p in enumerate(params) if p.needs_sampler]
        if drawn:
            raise InputError(f"generate: prompts {drawn[:5]} sample (temperature or repetition penalty), but the "
                             "engine was built without a sampler: build it with EngineOptions(sampler=(...filters))")
    else:
        for i, p in enumerate(params):
            missing = engine.sampler.missing(p)
            if missing:
                raise InputError(f"generate: prompt {i} needs the sampler's filters {missing}; the engine's has "
                                 f"{sorted(engine.sampler.filters)} (EngineOptions(sampler=...))")
    if engine.tp is not None:
        # Ranks given other requests would compute the same wrong tokens together, or diverge.
        engine.tp.check_same("the requests", {
            "prompts": _digest(prompts), "arrivals": _digest(arrivals), "max_new_tokens": max_new_tokens,
            "end-of-sequence ids": _digest(sorted(eos)), "sampling": _digest(params), "stop": int(stop is not None)},
            "every rank must generate for the same prompts, arrivals, max_new_tokens, end-of-sequence ids, sampling "
            "and stop")
    seeds = [request_seed(sp) for sp in params]
    if engine.tp is not None and any(sp.seed is None for sp in params):
        # Seeds drawn from each rank's own generator differ: every rank draws with rank 0's.
        seeds = engine.tp.broadcast(seeds, "the broadcast of the request seeds")
    reqs = [_Request(i, p, max_new_tokens, a, pages_for(len(p) + max_new_tokens, ps), sp, seed)
            for i, (p, a, sp, seed) in enumerate(zip(prompts, arrivals, params, seeds, strict=True))]
    assert o.max_pages is not None
    for r in reqs:
        if r.pages > o.max_pages:
            raise InputError(f"generate: prompt {r.index} ({len(r.prompt)} tokens) + {max_new_tokens} new tokens needs "
                             f"{r.pages} pages of {ps}; the cache has {o.max_pages} (raise max_pages)")
        if len(r.prompt) > o.max_prefill_tokens:
            raise InputError(f"generate: prompt {r.index} has {len(r.prompt)} tokens, more than max_prefill_tokens "
                             f"{o.max_prefill_tokens} (one step's prompt tokens); raise max_prefill_tokens")
    with torch.no_grad():
        return _Loop(engine, reqs, eos, on_step, stop).run()


class _Loop:
    def __init__(self, engine: Engine, reqs: list[_Request], eos: set[int],
                 on_step: Callable[[int, int], None] | None, stop: Stop | None) -> None:
        self.e, self.eos, self.on_step, self.stop = engine, eos, on_step, stop
        self.pending = sorted(reqs, key=lambda r: r.arrives)
        self.reqs = reqs
        self.active: list[_Request] = []  # joined, not yet removed
        self.steps: list[StepRecord] = []
        self.waits = 0
        self.t0 = 0.0
        self.ingested: set[str] = set()
        self._last_key: list[int] = []
        self._last: tuple[Step, str] | None = None
        self.produced = 0  # tokens appended to the requests' outputs so far
        self.step_no = 0  # the step being launched (what the ranks' checks name)
        # On CUDA a step's end is read from a timed event, against this one recorded at the start.
        self._origin: torch.cuda.Event | None = None

    def run(self) -> Generation:
        e = self.e
        if e.device.type == "cuda":
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        self.t0 = time.perf_counter()
        inflight: _Launched | None = None  # launched, not read
        last: _Launched | None = None  # the last step launched: the next one's decode tokens come from it
        limit = 100 * (len(self.reqs) + max(r.max_new for r in self.reqs)) + 1000
        total = sum(r.max_new for r in self.reqs)
        try:
            with stall_guard(e.tp, e.options.tp_timeout_s, "generate") as pet:
                while self.pending or self.active or inflight:
                    self._arrive(self.step_no)
                    launched = self._launch(last)
                    if inflight is not None:
                        self._read(inflight)
                    inflight = last = launched
                    if inflight is not None and inflight.ready is None:
                        self._read(inflight)  # it has run: nothing to overlap, nothing to drop
                        inflight = None
                    self._leave(inflight.rows if inflight else [])
                    self.step_no += 1
                    pet()
                    if self.on_step is not None:
                        self.on_step(self.produced, total)
                    if self.step_no > limit:
                        raise StateError(f"generate made no progress in {self.step_no} steps (a bug: please report it)")
            seconds = time.perf_counter() - self.t0
            if e.tp is not None:
                e.tp.check_same("the generated tokens", {
                    "count": self.produced, "checksum": _digest([r.generated for r in self.reqs])},
                    "the ranks computed different tokens")
        except RuntimeError as err:
            if e.tp is not None and is_collective_failure(err):  # a collective the model's layers ran
                raise peer_failed(e.tp.rank, f"step {self.step_no}", err) from err
            raise
        finally:
            # Cut short between a prepare and its launch (an interrupt, a host-side error), the
            # prepared step still holds its pages and staging slot: give them back first.
            try:
                e.runner.discard_all()
            finally:
                for rid in list(self.ingested):
                    e.node.remove_request(rid)
                    self.ingested.discard(rid)
                for r in self.reqs:
                    self._release(r)
        return Generation([r.generated for r in self.reqs], e.backend, tuple(self.steps), self.waits, seconds,
                          tuple(r.first_token_s or 0.0 for r in self.reqs), str(e.device),
                          None if e.runner.compiler is None else e.runner.compiler.describe(),
                          None if e.prefix_root is None else tuple(r.cached for r in self.reqs),
                          sum(len(r.prompt) for r in self.reqs))

    def _arrive(self, step_no: int) -> None:
        while self.pending and self.pending[0].arrives <= step_no:
            r = self.pending.pop(0)
            r.joined_at = time.perf_counter()
            self.active.append(r)

    def _launch(self, inflight: _Launched | None) -> _Launched | None:
        """Pick the step's rows, admit and plan them, gather their tokens on the device, launch."""
        e, o = self.e, self.e.options
        decode = [r for r in self.active if r.launched and r.running]
        joining = self._joining(decode)
        while True:
            rows = decode + joining
            if not rows:
                return None
            for r in joining:
                if r.rid not in self.ingested:
                    self.ingested.add(r.rid)  # first: removal is idempotent, a missed one leaks
                    e.node.ingest_request(r.rid)
                    if e.prefix_root is not None:
                        r.cached = e.kv.admit_prefix(r.rid, LABEL, r.prompt, e.prefix_root).cached_tokens
                if e.sampler is not None and r.slot is None:
                    r.slot = e.sampler.admit(r.params, r.seed, r.prompt)
            step, kind = self._step(rows)
            prep = e.runner.prepare(step)
            if prep.outcome:
                break
            if not joining:
                raise StateError(f"generate: a decode step of {len(decode)} requests was refused "
                                   f"({prep.outcome.reason()}); the cache ({o.max_pages} pages) is too small")
            log.info("request %s waits: %s", joining[-1].rid, prep.outcome.reason())
            r = joining.pop()
            self.waits += 1
            if e.prefix_root is not None:
                # The cached pages it took would be held while it waits, counted by nobody: it
                # gives them back and looks its prefix up again when it joins.
                e.node.remove_request(r.rid)
                self.ingested.discard(r.rid)
                r.cached = 0
        tokens = self._tokens(decode, joining, inflight)
        if e.sampler is not None:
            e.sampler.set_rows([r.slot for r in rows if r.slot is not None])
        out = e.runner.launch(prep, tokens)
        toks = out[: len(rows)]
        # Copied to the host now, in stream order right behind the draw: a plain read later
        # would queue behind the next step's replay and make the host wait for it too.
        host, ready = toks, None
        if toks.device.type == "cuda":
            host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
            host.copy_(toks, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
        for r in rows:
            r.launched += 1
        return _Launched(rows, toks, host, ready, time.perf_counter() - self.t0, kind, prep.graph is not None,
                         len(tokens))

    def _step(self, rows: list[_Request]) -> tuple[Step, str]:
        """The step of ``rows`` and its kind; a decode step of the same rows as the last one is
        reused (its spans are 64 validated objects per step otherwise)."""
        key = [r.index if r.launched else ~r.index for r in rows]
        if key != self._last_key:
            spans = tuple(KVSpan(r.rid, LABEL, 1 if r.launched else r.to_prefill) for r in rows)
            kind = STEP_KINDS[paged_step_capability(tuple(s.num_tokens for s in spans))]
            if self.e.tp is not None:
                # Before the step's first collective: ranks that admitted other rows would
                # otherwise all-reduce tensors of other shapes.
                self.e.tp.check_same(f"step {self.step_no}'s admission", {
                    "rows": len(rows), "tokens": sum(s.num_tokens for s in spans),
                    "free pages": self.e.kv.num_free_pages, "requests": _digest(key)})
            self._last_key, self._last = key, (Step(KVStep(spans), self.e.step_attn), kind)
        assert self._last is not None
        return self._last

    def _joining(self, decode: list[_Request]) -> list[_Request]:
        """Prompts that join this step: arrived, pages for their whole run free (counting what the
        running requests will still take), the step's row and prompt-token budgets not spent."""
        o = self.e.options
        assert o.max_pages is not None
        held = sum(r.pages for r in self.active if r.launched)
        budget, rows = o.max_prefill_tokens, len(decode)
        out: list[_Request] = []
        for r in self.active:
            if r.launched:
                continue
            cached = self._cached(r)
            if held + r.pages > o.max_pages or len(r.prompt) - cached > budget or rows >= o.max_batch_size:
                self.waits += 1
                log.debug("request %s waits (pages held %d + %d of %d, prompt budget %d)", r.rid, held, r.pages,
                          o.max_pages, budget)
                break  # first come, first served: later prompts do not overtake it
            if self._waits_for_prefix(r, cached, out):
                self.waits += 1
                continue  # it joins next step, from the pages this step publishes
            out.append(r)
            held += r.pages
            budget -= len(r.prompt) - cached
            rows += 1
        return out

    def _cached(self, r: _Request) -> int:
        """The tokens ``r`` finds (or found, once started) in the prefix cache; 0 without it."""
        e = self.e
        if e.prefix_root is None or r.rid in self.ingested:
            return r.cached
        return e.kv.match_prefix(r.prompt, e.prefix_root, LABEL)

    def _waits_for_prefix(self, r: _Request, cached: int, joining: list[_Request]) -> bool:
        """Whether ``r`` should wait for pages a prompt joining this step will publish: when the
        full pages it shares with one of them past ``cached`` are at least half of what it would
        compute now."""
        if self.e.prefix_root is None or r.rid in self.ingested:
            return False
        ps, p = self.e.options.page_size, r.prompt
        most = (len(p) - 1) // ps * ps  # what r can find at most: its last token is computed
        best = cached
        for j in joining:
            q = j.prompt
            n, top = cached, min(most, len(q) // ps * ps)  # j publishes its prompt's full pages
            while n + ps <= top and p[n: n + ps] == q[n: n + ps]:
                n += ps
            best = max(best, n)
        if 2 * (best - cached) < len(p) - cached:
            return False
        log.debug("request %s waits a step for %d prompt tokens another joining prompt computes", r.rid, best - cached)
        return True

    def _tokens(self, decode: list[_Request], joining: list[_Request], inflight: _Launched | None) -> torch.Tensor:
        """The step's input ids on the device: decode rows' last tokens gathered from the previous
        step's argmax (no host round trip), then the joining prompts."""
        dev = self.e.device
        parts = []
        if decode:
            assert inflight is not None
            if len(decode) == len(inflight.rows) and all(a is b for a, b in zip(decode, inflight.rows, strict=True)):
                parts.append(inflight.toks)  # the steady state: the same rows in the same order
            else:
                where = {id(r): i for i, r in enumerate(inflight.rows)}
                parts.append(inflight.toks[torch.tensor([where[id(r)] for r in decode], device=dev)])
        if joining:
            parts.append(torch.tensor([t for r in joining for t in r.prompt[r.cached:]], device=dev))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _read(self, step: _Launched) -> None:
        done_s = step.done_s
        if step.ready is not None:
            step.ready.synchronize()  # the one wait: for this step only (the next is already queued)
            assert self._origin is not None
            done_s = self._origin.elapsed_time(step.ready) / 1e3  # when the device finished it
        ids = step.host.tolist()
        self.steps.append(StepRecord(step.kind, len(step.rows), step.tokens, step.graph, done_s))
        for r, t in zip(step.rows, ids, strict=True):
            if r.stopped:
                continue  # computed before its end-of-sequence token or stop was seen: dropped
            r.generated.append(t)
            self.produced += 1
            if r.first_token_s is None:
                r.first_token_s = max(done_s - (r.joined_at - self.t0), 0.0)
            if t in self.eos or (self.stop is not None and self.stop(r.index, r.generated)):
                r.stopped = True

    def _leave(self, launched_rows: list[_Request]) -> None:
        """Remove requests that have nothing left to launch and none of whose tokens is unread."""
        unread = {id(r) for r in launched_rows}
        for r in [r for r in self.active if r.launched and not r.running and id(r) not in unread]:
            self.active.remove(r)
            if self.e.prefix_root is not None:
                self.e.kv.extend_tokens(r.rid, LABEL, r.generated)  # its committed full pages are published
            self.e.node.remove_request(r.rid)
            self.ingested.discard(r.rid)
            self._release(r)

    def _release(self, r: _Request) -> None:
        if r.slot is not None and self.e.sampler is not None:
            self.e.sampler.release(r.slot)
        r.slot = None
