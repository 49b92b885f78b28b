"""The host cost of preparing a graph decode step, on a CPU: ``GraphRunner.prepare`` (admit, KV
plan, attention plan) in a decode loop, through the reference wrappers and through the FlashInfer
plugin's wrappers over the stand-in library (tests/standins/flashinfer), so the plugin's own host
code is timed without a GPU.

    python3 bench/prepare_host.py --out $OUT       # writes prepare_host.json and .md

A SmolLM2-135M-shaped step: 9 query / 3 KV heads, head dim 64, page size 16, bf16, contexts drawn
from 512..2048, 64 and 256 rows (one graph bucket each). The cache holds one layer: prepare plans
once per step, not per layer, so the layer count changes nothing it does. Each step is prepared
(timed), then launched through the runner with a trivial forward and committed (untimed), so
contexts grow and rows cross page boundaries as in a real decode. "inner plan" is the time spent
in the wrapped library's own ``plan`` (the stand-in's, which is not FlashInfer's cost);
"mstar" is prepare without it. Target: mstar <= 200 us at 64 rows and <= 400 us at 256 rows on
a CPU like the development machine's (2 cores, EPYC).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import report
import torch

from mstar_core import GraphRunner, KVConfig, KVManager, KVSpan, KVStep, Node, PagedAttentionManager, Step, StepContext
from mstar_core.demo.decode_bench import lay_down
from mstar_core.testing.timing import paired_host_us

HQ, HKV, D, PS, DTYPE, LABEL = 9, 3, 64, 16, torch.bfloat16, "text"
CONTEXT = (512, 2048)
CPU = torch.device("cpu")
STANDINS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "standins"
TARGET_US = {64: 200.0, 256: 400.0}


def wrappers(backend: str) -> dict[str, type]:
    if backend == "reference":
        from mstar_core.backends import reference as R

        return {"paged_prefill": R.ReferencePrefillWrapper, "paged_decode": R.ReferenceDecodeWrapper,
                "mixed": R.ReferenceMixedWrapper}
    fi = sys.modules.get("flashinfer")
    if fi is None:  # (a test may have put the stand-in in place already)
        sys.path.insert(0, str(STANDINS))
        fi = importlib.import_module("flashinfer")
    if not getattr(fi, "STANDIN", False):
        raise RuntimeError(f"expected the FlashInfer stand-in, imported {fi.__file__}")
    fi.emulate("0.5.3")
    # the stand-in's JIT folder: one of this run's own (first-use notices read it)
    importlib.import_module("flashinfer.jit.env").FLASHINFER_JIT_DIR = pathlib.Path(tempfile.mkdtemp())
    from mstar_flashinfer.decode import FlashInferDecodeWrapper
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    return {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
            "mixed": FlashInferMixedWrapper}


def setup(backend: str, rows: int, steps: int, seed: int = 0) -> tuple[KVManager, PagedAttentionManager, Node,
                                                                         GraphRunner, Step]:
    """The managers under a warmed-up runner, ``rows`` requests holding their contexts, and the
    decode step."""
    rng = random.Random(seed)
    contexts = [rng.randint(*CONTEXT) for _ in range(rows)]
    pages = sum(-(-(c + steps) // PS) for c in contexts) + 4 * rows + 4
    cfg = KVConfig(1, HKV, D, PS, pages, HQ)
    kv = KVManager(cfg, CPU, DTYPE)
    attn = PagedAttentionManager(kv, CPU, DTYPE, cfg, wrappers(backend), accelerator_graph=True,
                                 max_batch_size=rows, max_total_tokens=max(sum(contexts), 16384))
    node = Node([kv, attn])
    runner = GraphRunner(node, lambda ctx, tokens: tokens[:, None].float(), [rows], CPU, LABEL)
    runner.warmup()
    rids = [f"r{i}" for i in range(rows)]
    lay_down(node, rids, LABEL, contexts)
    return kv, attn, node, runner, Step(KVStep(tuple(KVSpan(r, LABEL, 1) for r in rids)))


def time_inner_plans(attn: PagedAttentionManager) -> list[float]:
    """Wrap each built wrapper's library object's ``plan`` with a clock; the returned one-item
    list accumulates the seconds spent in them (nothing for wrappers without one)."""
    spent = [0.0]
    for w in attn._wrappers.values():  # the bench is the manager's own user
        inner = getattr(w, "_inner", None)
        if inner is None:
            continue

        def timed(*a: Any, _plan: Callable[..., Any] = inner.plan, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _plan(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        inner.plan = timed
    return spent


def measure(backend: str, rows: int, reps: int) -> dict:
    kv, attn, node, runner, decode = setup(backend, rows, 2 * reps + 16)
    tokens = torch.zeros(rows, dtype=torch.long)
    spent = time_inner_plans(attn)
    held: list[Any] = []
    inner: list[float] = []

    def prepare() -> None:
        before = spent[0]
        held.append(runner.prepare(decode))
        inner.append((spent[0] - before) * 1e6)

    def launch() -> None:
        runner.launch(held.pop(), tokens)

    (prep_us,) = paired_host_us([prepare], reps=reps, after=launch, device=CPU)
    inner_us = statistics.median(inner[1:])  # the first is paired_host_us's untimed warm-up call
    # Where it goes, one part at a time (the same calls the runner makes).
    parts: dict[str, list[float]] = {"admit": [], "kv_plan": [], "attn_plan": []}
    for i in range(reps):
        ctx = StepContext(slot=i % 2, bucket=rows)
        t0 = time.perf_counter()
        node.admit(decode, ctx)
        t1 = time.perf_counter()
        ctx.plan_results[kv.name] = kv.plan(decode, ctx)
        t2 = time.perf_counter()
        ctx.plan_results[attn.name] = attn.plan(decode, ctx)
        t3 = time.perf_counter()
        node.commit(decode, ctx)
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[k].append(v * 1e6)
    return {"backend": backend, "rows": rows, "prepare_us": prep_us, "inner_plan_us": inner_us,
            "mstar_us": prep_us - inner_us, "parts_us": {k: statistics.median(v) for k, v in parts.items()}}


def page(res: dict) -> list[str]:
    return ["# Host cost of preparing a graph decode step (CPU)", "", report.environment_line(res["env"]), "",
            f"{HQ}/{HKV} heads, head dim {D}, page size {PS}, bf16, contexts {CONTEXT[0]}..{CONTEXT[1]}; medians "
            f"of {res['reps']} steps, {res['threads']} intra-op thread(s). FlashInfer: the plugin over the stand-in "
            "library.", "",
            *report.table(("backend", "rows", "prepare us", "inner plan us", "mstar us",
                           "admit / kv plan / attn plan us"),
                          ((r["backend"], r["rows"], r["prepare_us"], r["inner_plan_us"], r["mstar_us"],
                            " / ".join(f"{r['parts_us'][k]:.0f}" for k in ("admit", "kv_plan", "attn_plan")))
                           for r in res["results"]), spec=".0f"),
            "", *report.targets_table(res["targets"]), *report.errors_section(res["errors"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=301)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--backends", default="reference,flashinfer")
    # One intra-op thread: the ops here take microseconds, and on a small shared machine an op
    # that wakes a second thread (repeat_interleave over the page indices) can wait milliseconds for it.
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    res: dict = {"env": report.environment(), "reps": a.reps, "threads": a.threads, "results": [], "errors": {},
                 "targets": {}}
    for backend in a.backends.split(","):
        for rows in (int(r) for r in a.rows.split(",")):
            try:
                r = measure(backend, rows, a.reps)
            except Exception as e:  # one shape's failure is recorded, the others still run
                res["errors"][f"{backend} x {rows}"] = repr(e)
                continue
            res["results"].append(r)
            if rows in TARGET_US:
                res["targets"][f"{backend}, {rows} rows: mstar us"] = report.target(
                    r["mstar_us"], f"<= {TARGET_US[rows]:.0f}", r["mstar_us"] <= TARGET_US[rows])
    report.write(a.out, "prepare_host", res, page(res))
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
