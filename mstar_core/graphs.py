"""CUDA-graph replay of decode steps, per batch-size bucket and staging slot, and the
pre-planned launch that lets the host plan step N+1 while step N runs.

Warm-up captures, for every bucket and slot, one graph of the model's forward over dummy
requests (one token each, or ``query_tokens`` each for multi-token decode: speculative
verification), sized through every resource's ``build_accelerator_graph_buffers``;
the dummies are cleared with ``reset_request(free=True)`` afterwards and every resource's
``post_warmup_validate`` runs. A step is replayed when it is decode-only, every resource
``can_capture()``, a bucket holds its rows and its mask parameters (``AttentionStep``) are the
ones captured; any other step (prefill, mixed, the dense manager, another window) runs eagerly
through the same resources.

Slots alternate between consecutive graph steps: step N+1 is planned into the other slot's
buffers and wrappers, so nothing step N's replay reads is overwritten
(``force_double_buffer``). On a CPU, "capture" keeps the closure and "replay" re-runs it over the
same static buffers — a functional check of the in-place discipline, not a speed-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.compiling import CompiledForward, StepCompiler
from mstar_core.errors import InputError, InputTypeError, StateError
from mstar_core.features import MAX_DECODE_QUERY_TOKENS, AttentionFeatures
from mstar_core.node import Node
from mstar_core.step import AdmitOutcome, AttentionStep, KVSpan, KVStep, Step, StepContext, elements, is_int

log = logging.getLogger(__name__)

# forward(ctx, tokens) -> logits [rows, vocab]; reads its positions etc. from ctx.plan_results
Forward = Callable[[StepContext, torch.Tensor], torch.Tensor]


@dataclass
class _Graph:
    ctx: StepContext
    tokens: torch.Tensor  # static input [bucket * query_tokens]
    out: torch.Tensor | None = None  # static output [bucket * query_tokens, vocab]
    replay: Callable[[], None] = lambda: None


@dataclass(eq=False)  # compared by identity: the runner finds its own open steps
class Prepared:
    """A step admitted and planned, ready to launch. ``graph`` None: runs eagerly."""

    step: Step
    ctx: StepContext
    rows: int
    graph: _Graph | None = None
    outcome: AdmitOutcome = field(default_factory=AdmitOutcome.ok)
    done: bool = False  # launched or discarded: its reservations are spent


def capture_graph(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph, after one eager run on a side stream; returns the replay
    (the graph lives as long as it). Off CUDA, ``fn`` itself."""
    if device.type != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside the graph: lazy inits and workspace allocations happen here
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def check_buckets(buckets: Any, who: str) -> tuple[int, ...]:
    """Graph batch sizes: a sequence or set of ints >= 1 (a numpy array or tensor by its
    elements); a mapping, a string or a single int is refused, naming it."""
    buckets = elements(buckets)
    if isinstance(buckets, (Mapping, str, bytes)) or not isinstance(buckets, (Sequence, AbstractSet)):
        raise InputTypeError(f"{who}: buckets must be a sequence of batch sizes (ints >= 1), got "
                             f"{type(buckets).__name__} {buckets!r}")
    if not buckets or any(not is_int(b) or b < 1 for b in buckets):
        raise InputError(f"{who}: buckets must be batch sizes, ints >= 1, got {list(buckets)}")
    return tuple(int(b) for b in buckets)


class GraphRunner:
    """Decode steps of one label through captured graphs, others eagerly."""

    def __init__(self, node: Node, forward: Forward, buckets: Sequence[int], device: torch.device | str,
                 label: str = "text", slots: int = 2, max_seq_len: int = 1 << 16,
                 attn: AttentionStep = AttentionStep(), query_tokens: int = 1,
                 compiled: CompiledForward | None = None) -> None:
        buckets = check_buckets(buckets, "GraphRunner")
        if compiled is not None and not isinstance(compiled, CompiledForward):
            raise InputTypeError(f"GraphRunner: compiled must be a CompiledForward or None, got "
                                 f"{type(compiled).__name__}")
        if not is_int(query_tokens) or not 1 <= query_tokens <= MAX_DECODE_QUERY_TOKENS:
            raise InputError(f"GraphRunner: query_tokens must be an int in 1..{MAX_DECODE_QUERY_TOKENS} (query tokens "
                             f"per decode row), got {query_tokens!r}")
        if query_tokens > 1:
            # Refused here, before warm-up takes buffers: each resource sized for its features.
            low = [(r.name, f.decode_query_tokens) for r in node.resources
                   if isinstance(f := getattr(r, "features", None), AttentionFeatures)
                   and f.decode_query_tokens < query_tokens]
            if low:
                raise InputError(
                    f"GraphRunner: query_tokens={query_tokens}, but resource(s) {[n for n, _ in low]} were built with "
                    f"features allowing decode_query_tokens={low[0][1]}; build them with "
                    f"AttentionFeatures(decode_query_tokens={query_tokens}) or lower query_tokens")
        if not is_int(slots) or slots < 1:
            raise InputError(f"GraphRunner: slots must be an int >= 1, got {slots!r}")
        double = [r.name for r in node.resources if r.force_double_buffer]
        if double and slots < 2:
            raise InputError(
                f"GraphRunner: slots={slots}; resources {double} force double-buffered staging, so at least 2")
        self.node = node
        self.forward = forward
        self.buckets = sorted(set(buckets))
        self.device = torch.device(device)
        self.label = label
        self.slots = slots
        self.max_seq_len = max_seq_len
        # The mask parameters the graphs are captured with: a replay reuses the kernel arguments
        # recorded at capture, so only steps with these exact parameters are replayed.
        self.attn = attn
        # Query tokens of every row of a captured step (1: plain decode; 2..8: multi-token decode,
        # which the attention manager's features must allow).
        self.query_tokens = query_tokens
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._next_slot = 0
        # Graph steps prepared and not yet launched or discarded, by staging slot: a slot's
        # static buffers and wrappers hold exactly one step's plan.
        self._pending: dict[int, Prepared] = {}
        # Every step prepared and not yet launched or discarded (graph or eager), oldest first:
        # what discard_all gives back when a caller's loop is cut short.
        self._open: list[Prepared] = []
        self.enabled = False
        # Graph steps run this compiled body (compiled per bucket at warm-up); None: ``forward``.
        self.compiler = None if compiled is None else StepCompiler(compiled)

    @property
    def supports_preplan(self) -> bool:
        """Whether the host may plan step N+1 while step N is in flight: graphs are captured (a
        graph step plans into its own slot) and every resource says it supports it."""
        return self.enabled and all(r.supports_preplan for r in self.node.resources)

    def warmup(self) -> None:
        """Capture every (bucket, slot) graph, or none when a resource cannot be captured; then
        run every resource's ``post_warmup_validate`` (either way: it also checks ranks agree)."""
        blockers = [r.name for r in self.node.resources if not r.can_capture()]
        if blockers:
            log.info("graphs off: resources %s cannot be captured; every step runs eagerly", blockers)
        else:
            for r in self.node.resources:
                r.build_accelerator_graph_buffers(self.slots, max(self.buckets), self.max_seq_len)
            try:
                for bucket in self.buckets:
                    for slot in range(self.slots):
                        self._graphs[(bucket, slot)] = self._capture_one(bucket, slot)
            except BaseException:
                # Nothing half-captured stays behind: the runner stays disabled (steps run eagerly)
                # and holds no graph.
                self._graphs.clear()
                raise
            self.enabled = True
            what = ("CUDA graphs" if self.device.type == "cuda" else
                    f"graph-path steps (on {self.device.type} a replay re-runs the forward; no CUDA graphs)")
            log.info("captured %d %s: buckets %s x %d slots%s", len(self._graphs), what, self.buckets, self.slots,
                     "" if self.compiler is None else f"; {self.compiler.describe()}")
        self.node.post_warmup_validate()

    def _capture_one(self, bucket: int, slot: int) -> _Graph:
        dummies = [f"__mstar_graph_{bucket}_{slot}_{i}" for i in range(bucket)]
        step = Step(KVStep(tuple(KVSpan(d, self.label, self.query_tokens) for d in dummies)), self.attn)
        ctx = self._context(slot, bucket)
        try:
            for d in dummies:
                self.node.ingest_request(d)
            outcome = self.node.admit(step, ctx)
            if not outcome:
                raise StateError(f"graph warm-up for bucket {bucket}: {outcome.reason()}")
            self.node.plan(step, ctx)
            g = _Graph(ctx, torch.zeros(bucket * self.query_tokens, dtype=torch.long, device=self.device))
            forward = self.forward if self.compiler is None else self.compiler

            def fn() -> None:
                out = forward(g.ctx, g.tokens)
                if g.out is None:
                    g.out = torch.empty_like(out)
                g.out.copy_(out)

            with self.node.bound(ctx):  # not inside fn: a replay binds the step it launches
                if self.compiler is not None and slot == 0:
                    self.compiler.compile(bucket, fn)  # once per bucket: every slot's graph runs it
                g.replay = capture_graph(fn, self.device)
        finally:
            # The dummies never commit: whatever happened, they leave nothing behind (the step
            # is rolled back first, so a reset does not park its pages for a step that never lands).
            self.node.rollback_admit(step, ctx)  # nothing, where the admit failed or was refused
            for d in dummies:
                self.node.reset_request(d, free=True)
        return g

    def _context(self, slot: int, bucket: int) -> StepContext:
        return StepContext(slot=slot, bucket=bucket, query_tokens=self.query_tokens)

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def prepare(self, step: Step) -> Prepared:
        """Admit and plan ``step`` (host work: this is what overlaps step N's replay)."""
        rows = len(step.kv.spans)
        decode = step.kv.uniform_tokens == self.query_tokens and step.kv.labels == (self.label,)
        if self.enabled and decode and step.attn != self.attn:
            log.debug("decode step with %s runs eagerly: graphs were captured with %s", step.attn, self.attn)
            decode = False
        bucket = self.bucket_for(rows) if (self.enabled and decode) else None
        if bucket is not None and self._next_slot in self._pending:
            # Checked before the admit: refusing here leaves nothing to undo.
            raise StateError(
                f"GraphRunner.prepare: staging slot {self._next_slot} still holds a prepared step that was "
                f"neither launched nor discarded; at most {self.slots} graph steps may be prepared ahead "
                "(launch or discard the oldest first)"
            )
        ctx = StepContext() if bucket is None else self._context(self._next_slot, bucket)
        # The plan goes into this slot's static buffers and wrappers, which the graph captured
        # for (bucket, slot) reads.
        prep = Prepared(step, ctx, rows, None if bucket is None else self._graphs[(bucket, ctx.slot)])
        outcome = self.node.admit(step, ctx)
        if not outcome:
            prep.outcome, prep.done = outcome, True
            return prep
        self._open.append(prep)  # held from here: whatever is raised next, discard_all finds it
        try:
            self.node.plan(step, ctx)
        except BaseException:
            # plan rolls its admit back itself, unless what was raised came before it got to;
            # a second rollback gives back nothing.
            self._finish(prep)
            self.node.rollback_admit(step, ctx)
            raise
        if bucket is not None:
            # The slot advances only for a step that holds it: a refusal must not make the next
            # graph step land in the slot the running step reads.
            self._next_slot = (self._next_slot + 1) % self.slots
            self._pending[ctx.slot] = prep
        return prep

    def _finish(self, prep: Prepared) -> None:
        """The step is launched or discarded: its reservations are spent, its slot free."""
        prep.done = True
        if prep in self._open:
            self._open.remove(prep)
        if prep.graph is not None and self._pending.get(prep.ctx.slot) is prep:
            del self._pending[prep.ctx.slot]

    def launch(self, prep: Prepared, tokens: torch.Tensor) -> torch.Tensor:
        """Run a prepared step (replay or eager) and commit it. Returns logits ``[tokens, vocab]``
        (a view of the graph's static output: read it before this slot's next replay). A step
        launches once; an exception in its forward rolls its admit back."""
        if not prep.outcome:
            raise StateError(f"launch of a refused step: {prep.outcome.reason()}")
        if prep.done:
            raise StateError("launch of a step that was already launched or discarded")
        want = sum(s.num_tokens for s in prep.step.kv.spans)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() != want:
            # Refused before anything runs: the step stays prepared (launch it again, or discard it).
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise InputError(f"GraphRunner.launch: tokens must be a 1-D tensor of the step's {want} tokens, got {got}")
        self._finish(prep)
        g = prep.graph
        try:
            # Whatever was planned since, this step's layers read this step's plans.
            with self.node.bound(prep.ctx):
                if g is None:
                    out = self.forward(prep.ctx, tokens)
                else:
                    g.tokens[:want].copy_(tokens, non_blocking=True)
                    g.tokens[want:].zero_()
                    g.replay()
                    assert g.out is not None
                    out = g.out[:want]
            self.node.commit(prep.step, prep.ctx)
        except BaseException:
            # Whatever has not committed is rolled back (a resource's rollback after its commit
            # finds no admit record and gives back nothing), even if the commit never began.
            self.node.rollback_admit(prep.step, prep.ctx)
            raise
        return out

    def discard(self, prep: Prepared) -> None:
        """Give back what a prepared step reserved without running it (end of a pipelined loop).
        Discarding a refused, launched or already discarded step does nothing."""
        if prep.outcome and not prep.done:
            self._finish(prep)
            self.node.rollback_admit(prep.step, prep.ctx)

    def discard_all(self) -> None:
        """Discard every prepared step not yet launched (newest first): what a loop cut short by
        an exception, between a prepare and its launch, calls so nothing stays reserved."""
        first: BaseException | None = None
        for prep in reversed(list(self._open)):
            try:
                self.discard(prep)
            except BaseException as e:  # the others are still given back
                log.error("discarding a prepared step raised %s: %s", type(e).__name__, e)
                first = first or e
        if first is not None:
            raise first

    def step(self, step: Step, tokens: torch.Tensor) -> torch.Tensor:
        return self.launch(self.prepare(step), tokens)
