"""The decode loop ``mstar bench`` times: a tiny decoder over ``batch`` requests that already
hold ``context`` tokens, one token per request per step (or ``query_tokens``: multi-token decode,
as speculative verification runs), through a chosen backend, eager or replayed from CUDA graphs,
with or without pre-planning; over ``tp`` tensor-parallel ranks, every rank running this same
loop (:mod:`mstar_core.distributed`)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mstar_core.attention.paged import PagedManager, build_paged_attention
from mstar_core.compiling import CompileOptions
from mstar_core.demo import TinyDecoder, TinyDecoderConfig
from mstar_core.distributed import DEFAULT_TIMEOUT_S, TensorParallel, check_shardable, stall_guard
from mstar_core.errors import InputError, StateError
from mstar_core.features import MAX_DECODE_QUERY_TOKENS, AttentionFeatures
from mstar_core.graphs import GraphRunner, capture_graph
from mstar_core.kv import KVConfig, KVManager
from mstar_core.memory import check_fits, format_bytes
from mstar_core.node import Node
from mstar_core.resource import resolve_dtype
from mstar_core.step import AttentionStep, KVSpan, KVStep, Step
from mstar_core.testing.timing import event, kernel_ms, sync

LABEL = "text"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchOptions:
    layers: int = 2
    qo_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    hidden: int = 256
    batch: int = 4
    context: int = 256
    page_size: int = 16
    backend: str | None = None
    graphs: bool = False
    preplan: bool = False
    steps: int = 20
    warmup: int = 3
    device: str = "cpu"
    dtype: str = "auto"
    query_tokens: int = 1  # per request per step; 2..8: multi-token decode rows
    config: Any = None  # a Config, a mapping or a TOML file: the backend's name and pins (mstar_core.config)
    tp: int = 1  # tensor-parallel ranks, the heads and the MLP sharded over them
    tp_timeout: float = DEFAULT_TIMEOUT_S  # seconds a rank waits for the others before it fails
    compile: bool = False  # graph steps run the model compiled by torch.compile (needs graphs)
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        if self.compile and not self.graphs:
            raise InputError("bench: compile compiles the graph steps (one compiled graph per bucket): use it with "
                             "graphs (--graphs; on a CPU the graph path runs without CUDA graphs)")
        if not 1 <= self.query_tokens <= MAX_DECODE_QUERY_TOKENS:
            raise InputError(f"bench: query_tokens must be in 1..{MAX_DECODE_QUERY_TOKENS}, got {self.query_tokens}")
        for name in ("layers", "qo_heads", "kv_heads", "head_dim", "hidden", "batch", "page_size", "steps", "warmup",
                     "tp"):
            if getattr(self, name) < 1:
                raise InputError(f"bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.context < 0:
            raise InputError(f"bench: context must be >= 0, got {self.context}")
        if self.qo_heads % self.kv_heads:
            raise InputError(f"bench: qo_heads ({self.qo_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        # the tiny model's MLP is 2 x hidden wide
        check_shardable(self.tp, self.qo_heads, self.kv_heads, 2 * self.hidden, who=f"bench --tp {self.tp}")


@dataclass(frozen=True)
class BenchResult:
    backend: str
    device: str
    dtype: str
    graphs: bool  # graphs requested and actually used
    preplan: bool  # pre-planning requested and supported by every resource
    median_step_ms: float
    tokens_per_s: float
    median_host_ms: float  # host time to admit + plan + launch one step (not waiting for the GPU)
    gpu_step_ms: float | None  # the step's kernels back to back (one graph replayed), CUDA only
    options: dict
    tp: int = 1  # tensor-parallel ranks; the step times are the slowest rank's medians
    # The step's all-reduces alone (2 per layer, [rows, hidden]), back to back the way the step
    # runs them (one graph with --graphs), in ms per step, and their share of the median step.
    allreduce_ms: float | None = None
    allreduce_share: float | None = None
    compile_s: float | None = None  # seconds torch.compile took at warm-up (None: not compiled)

    def lines(self) -> list[str]:
        cuda = self.device.startswith("cuda")
        if self.gpu_step_ms is not None:
            gpu = f"{self.gpu_step_ms:.3f} ms"
        else:
            gpu = "n/a (graphs off)" if cuda else f"n/a (no CUDA graphs on {self.device})"
        # Off CUDA the graph path runs, but no graph is captured: each replay re-runs the forward.
        graphs = "off" if not self.graphs else "on" if cuda else (
            f"on: the graph path, replayed on {self.device} (no CUDA graphs: each replay re-runs the forward)")
        tp = [] if self.tp == 1 or self.allreduce_ms is None or self.allreduce_share is None else [
            f"tensor parallel: {self.tp} ranks (step times: the slowest rank's); the step's all-reduces alone: "
            f"{self.allreduce_ms:.3f} ms ({self.allreduce_share:.0%} of the median step)"]
        return [
            f"backend: {self.backend} on {self.device} ({self.dtype}); graphs {graphs}, "
            f"pre-plan {'on' if self.preplan else 'off'}",
            f"median step time: {self.median_step_ms:.3f} ms ({self.tokens_per_s:.0f} tokens/s)",
            f"median host time per step: {self.median_host_ms:.3f} ms",
            f"GPU time per step: {gpu}",
            *tp,
            *([] if self.compile_s is None else [f"compiled at warm-up in {self.compile_s:.1f} s (torch.compile)"]),
        ]


@dataclass
class DecodeSetup:
    """Everything the loop runs, for scripts that time parts of it (bench/runner_steps.py)."""

    backend: str
    device: torch.device
    dtype: torch.dtype
    model: TinyDecoder
    kv: KVManager
    attn: PagedManager
    node: Node
    runner: GraphRunner
    decode: Step
    tp: TensorParallel | None = None


def kv_pages(o: BenchOptions) -> int:
    """Pages per rank's cache: every request's context and the steps' tokens, the graph
    warm-up's dummy rows and the sink page."""
    t = o.query_tokens
    total = o.context + t * (o.warmup + o.steps + 2)
    return o.batch * -(-total // o.page_size) + 2 * o.batch * -(-t // o.page_size) + 2


def estimate_bytes(o: BenchOptions, dtype: torch.dtype) -> tuple[int, int]:
    """``(KV cache, weights)`` in bytes that :func:`build_decode_setup` allocates on one rank."""
    size = dtype.itemsize
    kv = KVConfig(o.layers, o.kv_heads // o.tp, o.head_dim, o.page_size, kv_pages(o)).storage_bytes(size)
    h, qd, kd, mlp, vocab = o.hidden, o.qo_heads * o.head_dim, o.kv_heads * o.head_dim, 2 * o.hidden, 256
    per_layer = 2 * h + (h * qd + 2 * h * kd + qd * h + 3 * h * mlp) // o.tp
    return kv, (2 * vocab * h + h + o.layers * per_layer) * size


def check_memory(o: BenchOptions, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse sizes whose cache and weights do not fit the device's free memory, naming the
    options that size each, before anything is allocated."""
    kv, weights = estimate_bytes(o, dtype)
    check_fits(kv + weights, device, (
        f"bench: the KV cache ({format_bytes(kv)}: --layers {o.layers} x --batch {o.batch} x (--context {o.context} "
        f"+ --steps {o.steps} + --warmup {o.warmup}) x --kv-heads {o.kv_heads} x --head-dim {o.head_dim}, in pages of "
        f"--page-size {o.page_size}) and the weights ({format_bytes(weights)}: --layers {o.layers}, --hidden "
        f"{o.hidden}, --qo-heads {o.qo_heads})"))


def build_decode_setup(o: BenchOptions, tp: TensorParallel | None = None) -> DecodeSetup:
    """Model, KV cache holding ``context`` random tokens per request, attention on the chosen
    backend, and (with ``graphs``) the captured graphs. With ``tp`` (``o.tp`` ranks) this rank's
    shard of each; every rank of the group calls this."""
    _check_tp(o, tp)
    dev = torch.device(o.device)
    dt = resolve_dtype(o.dtype, dev)
    t = o.query_tokens
    check_memory(o, dev, dt)
    features = AttentionFeatures(decode_query_tokens=t)
    cfg = TinyDecoderConfig(vocab_size=256, hidden=o.hidden, num_layers=o.layers, num_qo_heads=o.qo_heads,
                            num_kv_heads=o.kv_heads, head_dim=o.head_dim, mlp=2 * o.hidden)
    model = TinyDecoder(cfg, dev, dt, tp=tp)
    pages = kv_pages(o)
    kvc = KVConfig(o.layers, model.num_kv_heads, o.head_dim, o.page_size, pages, model.num_qo_heads)
    kv = KVManager(kvc, dev, dt, features=features, tp=tp)
    attn = build_paged_attention(kv, dev, dt, kvc, o.backend, o.config, features, accelerator_graph=o.graphs,
                                 max_batch_size=max(o.batch, 1))
    node = Node([kv, attn])

    forward = model.step_forward(kv, attn, LABEL, CompileOptions(o.compile_backend))
    runner = GraphRunner(node, forward, [o.batch], dev, LABEL, query_tokens=t, compiled=forward if o.compile else None)
    if o.graphs:
        runner.warmup()  # validates every resource after capture
    else:
        node.post_warmup_validate()
    rids = [f"r{i}" for i in range(o.batch)]
    lay_down(node, rids, LABEL, [o.context] * o.batch)
    if tp is not None:
        node.post_warmup_validate()  # every rank holds the same context
    kv.storage.normal_()  # random K/V for the context (never zeros: they can run faster)
    decode = Step(KVStep(tuple(KVSpan(r, LABEL, t) for r in rids)))
    return DecodeSetup(str(attn.backend_name), dev, dt, model, kv, attn, node, runner, decode, tp)


def lay_down(node: Node, rids: Sequence[str], label: str, contexts: Sequence[int],
             attn: AttentionStep = AttentionStep()) -> None:
    """Ingest ``rids`` and give each ``contexts[i]`` committed tokens in one step with no forward
    (their K/V are whatever the cache holds): a bench's context, laid down in no time."""
    for r in rids:
        node.ingest_request(r)
    fill = Step(KVStep(tuple(KVSpan(r, label, n) for r, n in zip(rids, contexts, strict=True))), attn)
    if not node.step(fill, lambda ctx: None).outcome:
        raise StateError(f"bench: the KV cache cannot hold {sum(contexts)} context tokens over {len(rids)} requests")


def _check_tp(o: BenchOptions, tp: TensorParallel | None) -> None:
    have = tp.world_size if tp is not None else 1
    if have != o.tp:
        given = "no TensorParallel" if tp is None else f"a group of {have} ranks"
        raise InputError(f"bench: tp={o.tp} but {given} was "
                         "given; every rank passes its TensorParallel (mstar_core.distributed)")


def run_decode_bench(o: BenchOptions, setup: DecodeSetup | None = None,
                     tp: TensorParallel | None = None) -> BenchResult:
    """Time the loop. Under tensor parallelism every rank calls this with its ``tp``, and a rank
    whose peers stopped ends itself after ``o.tp_timeout`` (plus a grace) instead of hanging."""
    _check_tp(o, tp)
    with stall_guard(tp, o.tp_timeout, "bench") as pet:
        s = setup or build_decode_setup(o, tp)
        pet()
        return _timed_loop(o, s, pet)


def _timed_loop(o: BenchOptions, s: DecodeSetup, pet: Callable[[], None]) -> BenchResult:
    runner, decode, dev, tp = s.runner, s.decode, s.device, s.tp
    cuda = dev.type == "cuda"
    tokens = torch.zeros(o.batch * o.query_tokens, dtype=torch.long, device=dev)

    preplan = o.preplan and runner.supports_preplan
    if o.preplan and not preplan:
        blockers = [r.name for r in s.node.resources if not r.supports_preplan]
        why = f"resources {blockers} do not support it" if blockers else "graphs were not captured"
        log.warning("pre-plan off: %s (eager paged attention plans into the wrappers the running step "
                    "reads; use --graphs)", why)
    host: list[float] = []
    marks: list[Any] = []  # CUDA events, or the host clock's stand-ins
    prep = runner.prepare(decode) if preplan else None
    for _ in range(o.warmup + o.steps):
        if not preplan:
            if cuda:
                torch.cuda.current_stream().synchronize()  # without pre-plan the host waits for step N
            t0 = time.perf_counter()
            prep = runner.prepare(decode)
        else:
            t0 = time.perf_counter()
        assert prep is not None
        logits = runner.launch(prep, tokens)
        tokens = logits.argmax(-1)  # greedy, stays on the device: no sync
        if preplan:
            prep = runner.prepare(decode)  # step N+1 planned while step N runs
        host.append(time.perf_counter() - t0)
        pet()
        ev = event(dev)
        ev.record()
        marks.append(ev)
    if prep is not None and preplan:
        runner.discard(prep)  # the step planned ahead of a loop that ends here
    # A step's time is the interval between its mark and the previous one: the last warm-up
    # step's mark opens the first of ``steps`` timed intervals (warmup >= 1).
    sync(dev)
    steps = [marks[i - 1].elapsed_time(marks[i]) for i in range(o.warmup, len(marks))]
    step_ms, host_ms = statistics.median(steps), statistics.median(host[o.warmup:]) * 1e3
    gpu_ms = _gpu_time(runner, o.batch) if (cuda and runner.enabled) else None
    ar_ms = None
    if tp is not None:
        ar_ms = _allreduce_time(tp, o.batch * o.query_tokens, o.hidden, 2 * o.layers, s.dtype, dev, runner.enabled)
        # Ranks run in lock step; report the slowest rank's figures (-1: no GPU time on any).
        step_ms, host_ms, ar_ms, gpu = tp.max(step_ms, host_ms, ar_ms, -1.0 if gpu_ms is None else gpu_ms)
        gpu_ms = None if gpu < 0 else gpu
    pet()
    return BenchResult(
        s.backend, str(dev), str(s.dtype).replace("torch.", ""), runner.enabled, preplan, step_ms,
        o.batch * o.query_tokens / (step_ms / 1e3), host_ms, gpu_ms, asdict(o), o.tp, ar_ms,
        ar_ms / step_ms if ar_ms is not None else None,
        None if runner.compiler is None else runner.compiler.total_seconds,
    )


def _time_ms(run: Callable[[], None], device: torch.device, reps: int = 20) -> float:
    """ms per call of ``run``, back to back after one untimed call: CUDA events, else the host clock."""
    return kernel_ms(run, reps=reps, rounds=1, warm=1, device=device)


def _gpu_time(runner: GraphRunner, batch: int) -> float:
    """One step's kernels back to back: the captured graph replayed with no host work between."""
    bucket = runner.bucket_for(batch)
    assert bucket is not None  # the runner's one bucket is the bench's batch
    g = runner._graphs[(bucket, 0)]  # private: the bench is the runner's own user
    return _time_ms(g.replay, runner.device)


def _allreduce_time(tp: TensorParallel, rows: int, hidden: int, count: int, dtype: torch.dtype,
                    device: torch.device, graph: bool) -> float:
    """ms for a step's ``count`` all-reduces of ``[rows, hidden]`` alone, back to back: replayed
    from one captured graph when the step is (``graph``), else launched eagerly."""
    buf = torch.zeros(rows, hidden, dtype=dtype, device=device)  # zeros: the sums stay finite

    def step() -> None:
        for _ in range(count):
            tp.all_reduce(buf)

    return _time_ms(capture_graph(step, device) if graph else step, device)
