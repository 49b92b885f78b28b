"""The main demo: a tiny decoder serving requests that join and leave (continuous batching),
every generated token's logits checked against a no-cache full forward of the same model."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mstar_core.attention.paged import PagedAttentionManager
from mstar_core.capabilities import PAGED, STEP_KINDS, paged_step_capability
from mstar_core.config import ConfigSource
from mstar_core.demo import TinyDecoder, TinyDecoderConfig
from mstar_core.distributed import DEFAULT_TIMEOUT_S, TensorParallel, stall_guard
from mstar_core.errors import StateError
from mstar_core.kv import KVConfig, KVManager
from mstar_core.node import Node
from mstar_core.step import KVSpan, KVStep, Step, StepContext

log = logging.getLogger(__name__)
LABEL = "text"


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_new: int
    arrives: int  # step index at which it joins
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one per generated token
    prefilled: bool = False

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new

    @property
    def step_tokens(self) -> list[int]:
        """The tokens this request runs in its next step: the prompt, then the last generated one."""
        return self.prompt if not self.prefilled else self.generated[-1:]


@dataclass(frozen=True)
class DemoReport:
    backend: str
    steps: dict[str, int]
    waits: int
    tokens: int
    seconds: float
    max_error: float
    tolerance: float
    tp: int = 1  # ranks the model was sharded over
    # Each request's generated tokens' logits [tokens, vocab] (float32, CPU): what a sharded run
    # is compared with.
    logits: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance

    def lines(self) -> list[str]:
        kinds = ", ".join(f"{k} {v}" for k, v in self.steps.items())
        return [
            f"backend: {self.backend}" + (f"; tensor parallel over {self.tp} ranks" if self.tp > 1 else ""),
            f"steps: {sum(self.steps.values())} ({kinds}); admissions deferred for lack of pages: {self.waits}",
            f"tokens: {self.tokens} in {self.seconds:.2f} s ({self.tokens / max(self.seconds, 1e-9):.0f} tokens/s)",
            f"largest |logit error| vs no-cache forward: {self.max_error:.3g} (tolerance {self.tolerance:g}): "
            + ("OK" if self.ok else "MISMATCH"),
        ]


def make_requests(vocab: int, seed: int) -> list[Request]:
    """Prompts of different lengths (1, a page boundary, several pages) arriving over time."""
    g = torch.Generator().manual_seed(seed)
    spec = [(5, 8, 0), (17, 6, 0), (33, 10, 2), (1, 5, 3), (16, 7, 5), (9, 4, 9)]
    return [
        Request(f"r{i}", torch.randint(0, vocab, (n,), generator=g).tolist(), new, at)
        for i, (n, new, at) in enumerate(spec)
    ]


def run_text_demo(
    wrappers: Mapping[str, type],
    backend_name: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    page_size: int = 16,
    max_pages: int = 7,
    num_layers: int = 2,
    tp: TensorParallel | None = None,
    tp_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DemoReport:
    """Serve :func:`make_requests` to completion and compare every generated token's logits.

    ``max_pages`` is kept small on purpose so that some admissions are refused for lack of
    pages and wait for a request to leave: the refusal path runs in every demo.

    With ``tp`` every rank of the group calls this: the model's heads are sharded, every rank
    schedules the same requests (the logits after each block's all-reduce are the same on every
    rank, so are the tokens), each step checks that the ranks admitted the same rows before its
    forward, and rank 0 checks the tokens against the no-cache forward of the unsharded model;
    every rank's report carries rank 0's error. A rank that makes no step's progress for
    ``tp_timeout_s`` (plus a grace) ends itself (:func:`~mstar_core.distributed.stall_guard`)."""
    cfg = TinyDecoderConfig(num_layers=num_layers)
    model = TinyDecoder(cfg, device, dtype, seed=seed, tp=tp)
    kv_cfg = KVConfig(cfg.num_layers, model.num_kv_heads, cfg.head_dim, page_size, max_pages, model.num_qo_heads)
    kv = KVManager(kv_cfg, device, dtype, tp=tp)
    attn = PagedAttentionManager(kv, device, dtype, kv_cfg, wrappers, backend_name=backend_name)
    node = Node([attn, kv])

    def forward(batch: list[Request], ctx: StepContext) -> None:
        if tp is not None:
            # Before the first collective of the step: ranks that admitted different rows would
            # otherwise all-reduce tensors of different shapes.
            n = sum(len(r.step_tokens) for r in batch)
            tp.check_same(f"step {step_no}'s admission",
                          {"rows": len(batch), "tokens": n, "free pages": kv.num_free_pages})
        _forward(model, kv, attn, batch, ctx, device)

    pending = make_requests(cfg.vocab_size, seed)
    active: list[Request] = []
    finished: list[Request] = []
    kinds = {"prefill": 0, "mixed": 0, "decode": 0}
    waits, tokens, step_no = 0, 0, 0
    with stall_guard(tp, tp_timeout_s, "demo") as pet:
        t0 = time.perf_counter()
        while pending or active:
            for r in [r for r in pending if r.arrives <= step_no]:
                pending.remove(r)
                node.ingest_request(r.rid)
                active.append(r)
            batch = list(active)
            while batch:
                spans = tuple(
                    KVSpan(r.rid, LABEL, len(r.step_tokens)) for r in batch
                )
                step = Step(KVStep(spans))
                res = node.step(step, functools.partial(forward, batch))
                if res.outcome:
                    break
                # Refused: the newest request not yet prefilled waits for pages.
                waiting = [r for r in batch if not r.prefilled]
                if not waiting:
                    raise StateError(f"decode step refused with nothing to defer: {res.outcome.reason()}")
                batch.remove(waiting[-1])
                waits += 1
                log.info("request %s waits: %s", waiting[-1].rid, res.outcome.reason())
            if batch:
                kind = paged_step_capability(tuple(len(r.step_tokens) for r in batch))
                kinds[STEP_KINDS[kind]] += 1
                tokens += sum(len(r.step_tokens) for r in batch)
                for r in batch:
                    r.prefilled = True
            for r in [r for r in active if r.done]:
                active.remove(r)
                node.remove_request(r.rid)
                finished.append(r)
            step_no += 1
            pet()
            if step_no > 1000:
                raise StateError("demo did not finish in 1000 steps")
        seconds = time.perf_counter() - t0
        # Under tensor parallelism rank 0 checks against the unsharded model (same seed: the function
        # the shards compute together), and an all-reduce hands its error to every rank (others add 0).
        err = 0.0
        if tp is None or tp.rank == 0:
            whole = model if tp is None else TinyDecoder(cfg, device, dtype, seed=seed)
            err = max(_check(whole, r) for r in finished)
        if tp is not None:
            err = float(tp.all_reduce(torch.tensor([err], dtype=torch.float64, device=device),
                                      "the error's all-reduce"))
    tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    logits = {r.rid: torch.stack(r.logits) for r in finished}
    return DemoReport(backend_name, kinds, waits, tokens, seconds, err, tol, tp.world_size if tp else 1, logits)


def _forward(model: TinyDecoder, kv: KVManager, attn: PagedAttentionManager, batch: list[Request],
             ctx: StepContext, device: str) -> None:
    lay = ctx.plan_results[kv.name].layout(LABEL)
    toks = [t for r in batch for t in r.step_tokens]
    logits = model.forward_step(torch.tensor(toks, device=device), lay.positions, kv, attn, LABEL)
    for r, span in zip(batch, lay.spans, strict=True):
        last = logits[span.q_start + span.to_compute - 1].float().cpu()
        r.logits.append(last)
        r.generated.append(int(last.argmax()))


def reference_logits(model: TinyDecoder, r: Request) -> torch.Tensor:
    """The logits ``[generated, vocab]`` the no-cache forward gives for ``r``'s generated tokens:
    one full causal forward over its prompt and generated tokens."""
    seq = r.prompt + r.generated[:-1]
    return model.forward_full(torch.tensor(seq, device=model.device))[len(r.prompt) - 1:].float().cpu()


def _check(model: TinyDecoder, r: Request) -> float:
    """Largest logit error of ``r``'s generated tokens against the no-cache forward."""
    return float((torch.stack(r.logits) - reference_logits(model, r)).abs().max())


def main(backend: str | None = None, device: str = "cpu", seed: int = 0, config: ConfigSource = None,
         tp: TensorParallel | None = None, tp_timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """``mstar demo``: pick the paged backend (by name, config, env or auto), run, report. With
    ``tp`` this is one rank of a tensor-parallel run (``device`` its own); rank 0 prints."""
    from mstar_core.registry import select_backend

    dev = torch.device(device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    sel = select_backend(capabilities=PAGED, requested=backend, device=dev, dtype=dtype,
                         head_dim=TinyDecoderConfig().head_dim, config=config)
    report = run_text_demo(sel.classes, sel.name, device, dtype, seed, tp=tp, tp_timeout_s=tp_timeout_s)
    if tp is None or tp.rank == 0:
        for line in report.lines():
            print(line)
    return 0 if report.ok else 1
