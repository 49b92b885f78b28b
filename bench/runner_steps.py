"""The step runner on the GPU: a 32-layer decode at 64 requests x 8192 tokens (32 / 8 heads, head
dim 128, bf16, FlashInfer), eager vs graphs vs graphs + pre-plan, against the GPU time of the same
kernels back to back and against raw FlashInfer decode measured in this same process.

    python3 bench/runner_steps.py --out $OUT     # writes runner_steps.json and .md

Targets: a graphs + pre-plan step <= 1.10x the step's kernels replayed back to back; one layer's
attention >= 90% of the device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses

import report
import torch
from paged import workspace

from mstar_core import StepContext
from mstar_core.demo.decode_bench import BenchOptions, build_decode_setup, run_decode_bench
from mstar_core.testing.oracle import rel_error
from mstar_core.testing.timing import copy_bandwidth, events_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args(argv)
    import flashinfer

    bw = copy_bandwidth()["tb_per_s"] * 1e12
    o = BenchOptions(layers=a.layers, qo_heads=32, kv_heads=8, head_dim=128, hidden=a.hidden, batch=a.batch,
                     context=a.context, page_size=16, backend="flashinfer", graphs=True, preplan=False,
                     steps=a.steps, warmup=5, device="cuda", dtype="bfloat16")
    # one cache for the three modes: room for every mode's steps
    s = build_decode_setup(dataclasses.replace(o, steps=3 * (o.steps + o.warmup) + 2))
    assert s.runner.enabled, "graphs were not captured"
    modes = {}
    s.runner.enabled = False  # the same cache and model, every step eager
    modes["eager"] = run_decode_bench(dataclasses.replace(o, graphs=False), s)
    s.runner.enabled = True
    modes["graphs"] = run_decode_bench(o, s)
    modes["graphs+preplan"] = run_decode_bench(dataclasses.replace(o, preplan=True), s)

    # Attention alone, one layer: mstar's decode wrapper vs raw FlashInfer, same plan arrays.
    ctx = StepContext()
    assert s.node.admit(s.decode, ctx)
    kvplan = s.kv.plan(s.decode, ctx)
    ctx.plan_results["kv"] = kvplan
    s.attn.plan(s.decode, ctx)
    lay = kvplan.layout("text")
    q = torch.randn(a.batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    layer = s.kv.layer_view(0)
    mstar_ms = events_ms(lambda: s.attn.run(q, "text", layer, layer_idx=0), reps=50)
    raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=True)
    raw.plan(lay.kv_indptr.cuda(), lay.kv_indices.cuda(), lay.kv_last_page_len.cuda(), 32, 8, 128, 16,
             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    raw_ms = events_ms(lambda: raw.run(q, layer), reps=50)
    out_m = s.attn.run(q, "text", layer, layer_idx=0)
    out_r = raw.run(q, layer)
    agree = rel_error(out_m, out_r.to("cpu", torch.float64))
    for r in reversed(s.node.resources):
        r.rollback_admit(s.decode, ctx)
    kv_bytes = int(lay.kv_lens.sum()) * 8 * 128 * 2 * 2  # K and V, bf16, one layer
    gpu_ms = modes["graphs+preplan"].gpu_step_ms
    t_step = modes["graphs+preplan"].median_step_ms
    attn_bw = kv_bytes / (mstar_ms / 1e3)
    res = {
        "env": report.environment(),
        "shape": {"layers": a.layers, "batch": a.batch, "context": a.context, "qo_heads": 32, "kv_heads": 8,
                  "head_dim": 128, "hidden": a.hidden, "page_size": 16, "dtype": "bfloat16"},
        "copy_bandwidth_TBps": bw / 1e12,
        "modes": {k: dataclasses.asdict(v) for k, v in modes.items()},
        "attention_layer_ms": {"mstar": mstar_ms, "raw_flashinfer": raw_ms, "ratio": mstar_ms / raw_ms,
                               "mstar_vs_raw_rel_diff": agree},
        "attention_bandwidth_TBps": attn_bw / 1e12,
        "attention_share_of_step": a.layers * mstar_ms / t_step,
        "targets": {
            "graphs+preplan step / GPU time back to back": report.target(
                t_step / gpu_ms if gpu_ms else None, "<= 1.10", bool(gpu_ms and t_step <= 1.10 * gpu_ms)),
            "attention: fraction of copy bandwidth": report.target(attn_bw / bw, ">= 0.90", attn_bw >= 0.9 * bw),
        },
    }
    lines = [f"# Decode loop, {a.layers} layers, {a.batch} x {a.context}, 32/8 heads, d128, bf16, FlashInfer", "",
             report.environment_line(res["env"]), "", f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s", "",
             *report.table(("mode", "median step ms", "host ms/step", "GPU ms/step (graph back to back)", "tokens/s"),
                           ((k, v.median_step_ms, v.median_host_ms, v.gpu_step_ms, round(v.tokens_per_s))
                            for k, v in modes.items()), spec=".4g"),
             "", f"attention per layer: mstar {mstar_ms:.4f} ms, raw FlashInfer {raw_ms:.4f} ms "
             f"(ratio {mstar_ms / raw_ms:.3f}; outputs differ by {agree:.2e} rel)",
             f"attention bandwidth: {res['attention_bandwidth_TBps']:.2f} TB/s; "
             f"share of the step: {res['attention_share_of_step']:.0%}", "", *report.targets_table(res["targets"])]
    report.write(a.out, "runner_steps", res, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
