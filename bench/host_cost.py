"""The host cost of a decode step on the GPU, against raw FlashInfer in this process.

    python3 bench/host_cost.py --out $OUT     # writes host_cost.json and .md

1. ``GraphRunner.prepare`` of a decode step (admit + KV plan + attention plan, graph mode) against
   the raw FlashInfer decode ``plan()`` it wraps, from 8 x 512 to 256 x 8192 (batch x context):
   32 query / 8 KV heads, head dim 128, page size 16, bf16. The raw plan is timed as an engine would call
   it in graph mode: its static buffers given at construction, ``indptr``/``last_page_len``/
   ``seq_lens`` on the host and the page indices already on the device. Both are timed in
   alternating calls with the GPU idle before each (medians). Targets: prepare <= 1.2x raw
   plan at every shape; prepare(256 x 8192) / prepare(256 x 2048) <= 1.1.
2. 8-layer decode (hidden 2048) with graphs + pre-planning at 256 x 8192 and 256 x 2048: median
   step time against the same step's kernels replayed back to back. Target <= 1.05.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback

import report
import torch
from paged import BF16, HKV, HQ, PS, D, workspace

from mstar_core import StepContext
from mstar_core.demo.decode_bench import BenchOptions, build_decode_setup, run_decode_bench
from mstar_core.testing.timing import paired_host_us

SHAPES = ((8, 512), (64, 2048), (64, 8192), (256, 2048), (256, 8192))


def prepare_vs_raw(batch: int, context: int, reps: int) -> dict:
    import flashinfer

    from mstar_flashinfer.decode import use_tensor_cores

    o = BenchOptions(layers=1, qo_heads=HQ, kv_heads=HKV, head_dim=D, hidden=256, batch=batch, context=context,
                     page_size=PS, backend="flashinfer", graphs=True, steps=4 * reps, warmup=1, device="cuda",
                     dtype="bfloat16")
    s = build_decode_setup(o)
    assert s.runner.enabled, "graphs were not captured"
    # The raw plan's inputs: one plan's arrays, the page indices on the device.
    ctx = StepContext()
    assert s.node.admit(s.decode, ctx)
    lay = s.kv.plan(s.decode, ctx).layout("text")
    indptr, last, lens = lay.kv_indptr.clone(), lay.kv_last_page_len.clone(), lay.kv_lens.clone()
    indices = lay.kv_indices.clone()
    s.node.rollback_admit(s.decode, ctx)
    i32 = dict(dtype=torch.int32, device="cuda")
    raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace(), "NHD", use_cuda_graph=True,
        use_tensor_cores=use_tensor_cores(HQ, HKV), paged_kv_indptr_buffer=torch.zeros(batch + 1, **i32),
        paged_kv_indices_buffer=torch.zeros(indices.numel() + batch, **i32),
        paged_kv_last_page_len_buffer=torch.ones(batch, **i32))

    def raw_plan():
        raw.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, kv_data_type=BF16, non_blocking=True,
                 seq_lens=lens)

    held = []

    def prepare():
        held.append(s.runner.prepare(s.decode))

    def undo():
        while held:
            s.runner.discard(held.pop())

    raw_us, prep_us = paired_host_us([raw_plan, prepare], reps=reps, after=undo)
    # Where prepare's time goes (the same calls, one part at a time).
    parts: dict[str, list[float]] = {"admit": [], "kv_plan": [], "attn_plan": []}
    for _ in range(reps):
        ctx = StepContext(slot=0, bucket=batch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.node.admit(s.decode, ctx)
        t1 = time.perf_counter()
        ctx.plan_results["kv"] = s.kv.plan(s.decode, ctx)
        t2 = time.perf_counter()
        s.attn.plan(s.decode, ctx)
        t3 = time.perf_counter()
        s.node.rollback_admit(s.decode, ctx)
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=False):
            parts[k].append(v * 1e6)
    res = {"batch": batch, "context": context, "pages": int(indices.numel()), "raw_plan_us": raw_us,
           "prepare_us": prep_us, "ratio": prep_us / raw_us,
           "parts_us": {k: statistics.median(v) for k, v in parts.items()}}
    return res


def eight_layers(batch: int, context: int, steps: int) -> dict:
    o = BenchOptions(layers=8, qo_heads=HQ, kv_heads=HKV, head_dim=D, hidden=2048, batch=batch, context=context,
                     page_size=PS, backend="flashinfer", graphs=True, preplan=True, steps=steps, warmup=5,
                     device="cuda", dtype="bfloat16")
    s = build_decode_setup(dataclasses.replace(o, steps=2 * (steps + 5) + 2))
    out = {}
    for mode, opts in (("graphs", dataclasses.replace(o, preplan=False)), ("graphs+preplan", o)):
        r = run_decode_bench(opts, s)
        out[mode] = {"median_step_ms": r.median_step_ms, "median_host_ms": r.median_host_ms,
                     "gpu_step_ms": r.gpu_step_ms, "vs_gpu": r.median_step_ms / r.gpu_step_ms}
    return {"batch": batch, "context": context, **out}


def page(res: dict) -> list[str]:
    return [f"# Host cost of a decode step -- {res['env']['device']}", "", report.environment_line(res["env"]), "",
            f"{HQ}/{HKV} heads, head dim {D}, page size {PS}, bf16, graph mode. Medians.", "",
            "## prepare() vs raw FlashInfer decode plan()", "",
            *report.table(("batch x context", "pages", "raw plan us", "mstar prepare us", "ratio",
                           "admit / kv plan / attn plan us"),
                          ((f"{r['batch']} x {r['context']}", r["pages"], round(r["raw_plan_us"]),
                            round(r["prepare_us"]), r["ratio"],
                            " / ".join(f"{r['parts_us'][k]:.0f}" for k in ("admit", "kv_plan", "attn_plan")))
                           for r in res["prepare"])),
            "", "## 8-layer decode, hidden 2048", "",
            *report.table(("batch x context", "mode", "median step ms", "host ms/step", "GPU ms/step (back to back)",
                           "step / GPU"),
                          ((f"{r['batch']} x {r['context']}", mode, *(r[mode][k] for k in (
                              "median_step_ms", "median_host_ms", "gpu_step_ms", "vs_gpu")))
                           for r in res["eight_layers"] for mode in ("graphs", "graphs+preplan")), spec=".4g"),
            "", *report.targets_table(res["targets"]), *report.errors_section(res["errors"])]


def targets(res: dict) -> dict:
    t = {f"prepare / raw plan at {r['batch']} x {r['context']}": report.target(r["ratio"], "<= 1.2", r["ratio"] <= 1.2)
         for r in res["prepare"]}
    by = {(r["batch"], r["context"]): r for r in res["prepare"]}
    if (256, 8192) in by and (256, 2048) in by:
        flat = by[(256, 8192)]["prepare_us"] / by[(256, 2048)]["prepare_us"]
        t["prepare(256 x 8192) / prepare(256 x 2048)"] = report.target(flat, "<= 1.1", flat <= 1.1)
    for r in res["eight_layers"]:
        v = r["graphs+preplan"]["vs_gpu"]
        t[f"8 layers, graphs+preplan, {r['batch']} x {r['context']}: step / GPU"] = report.target(
            v, "<= 1.05", v <= 1.05)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    res: dict = {"env": report.environment(), "errors": {}, "prepare": [], "eight_layers": []}

    def section(name, fn):
        try:
            res[name].append(fn())
        except Exception:  # one shape's failure is recorded, the others still run
            res["errors"][name] = res["errors"].get(name, "") + traceback.format_exc()[-3000:]
            traceback.print_exc()
        torch.cuda.empty_cache()  # the setup of one shape is gone before the next is built

    for b, c in SHAPES:
        section("prepare", lambda b=b, c=c: prepare_vs_raw(b, c, a.reps))
    for c in (8192, 2048):
        section("eight_layers", lambda c=c: eight_layers(256, c, a.steps))
    res["targets"] = targets(res)
    report.write(a.out, "host_cost", res, page(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
