"""Issue 7 on the GPU: a 32-layer decode at 64 requests x 8192 tokens (32 / 8 heads, head_dim
128, bf16, FlashInfer), eager vs graphs vs graphs + pre-plan, against the GPU time of the same
kernels back to back and against raw FlashInfer decode measured in this same process.

    python3 bench/runner_bench.py --out $OUT     (needs flashinfer: source .gpu/env.sh flashinfer)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from timing import copy_bandwidth, events_ms

from mstar_core.step import StepContext
from mstar_core.demo.decode_bench import BenchOptions, build_decode_setup, run_decode_bench


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
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
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    raw.plan(lay.kv_indptr.cuda(), lay.kv_indices.cuda(), lay.kv_last_page_len.cuda(), 32, 8, 128, 16,
             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    raw_ms = events_ms(lambda: raw.run(q, layer), reps=50)
    out_m = s.attn.run(q, "text", layer, layer_idx=0)
    out_r = raw.run(q, layer)
    agree = float((out_m.float() - out_r.float()).norm() / out_r.float().norm())
    for r in reversed(s.node.resources):
        r.rollback_admit(s.decode, ctx)
    kv_bytes = int(lay.kv_lens.sum()) * 8 * 128 * 2 * 2  # K and V, bf16, one layer
    gpu_ms = modes["graphs+preplan"].gpu_step_ms
    res = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "flashinfer": flashinfer.__version__, "python": sys.version.split()[0],
        "shape": {"layers": a.layers, "batch": a.batch, "context": a.context, "qo_heads": 32, "kv_heads": 8,
                  "head_dim": 128, "hidden": a.hidden, "page_size": 16, "dtype": "bfloat16"},
        "copy_bandwidth_TBps": bw / 1e12,
        "modes": {k: dataclasses.asdict(v) for k, v in modes.items()},
        "attention_layer_ms": {"mstar": mstar_ms, "raw_flashinfer": raw_ms, "ratio": mstar_ms / raw_ms,
                               "mstar_vs_raw_rel_diff": agree},
        "attention_bandwidth_TBps": kv_bytes / (mstar_ms / 1e3) / 1e12,
        "attention_share_of_step": a.layers * mstar_ms / modes["graphs+preplan"].median_step_ms,
    }
    t_step = modes["graphs+preplan"].median_step_ms
    res["targets"] = {
        "graphs+preplan step <= 1.10 x GPU time back to back": {"value": t_step / gpu_ms if gpu_ms else None,
                                                                "met": bool(gpu_ms and t_step <= 1.10 * gpu_ms)},
        "attention >= 90% of copy bandwidth": {"value": res["attention_bandwidth_TBps"] * 1e12 / bw,
                                               "met": res["attention_bandwidth_TBps"] * 1e12 >= 0.9 * bw},
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runner_bench.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Decode loop, {a.layers} layers, {a.batch} x {a.context}, 32/8 heads, d128, bf16, FlashInfer",
             f"device {res['device']}, torch {res['torch']}, CUDA {res['cuda']}, flashinfer {res['flashinfer']}",
             f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s", "",
             "| mode | median step ms | host ms/step | GPU ms/step (graph back to back) | tokens/s |",
             "| --- | --- | --- | --- | --- |"]
    for k, v in modes.items():
        g = f"{v.gpu_step_ms:.3f}" if v.gpu_step_ms else "-"
        lines.append(f"| {k} | {v.median_step_ms:.3f} | {v.median_host_ms:.3f} | {g} | {v.tokens_per_s:.0f} |")
    lines += ["", f"attention per layer: mstar {mstar_ms:.4f} ms, raw FlashInfer {raw_ms:.4f} ms "
              f"(ratio {mstar_ms / raw_ms:.3f}; outputs differ by {agree:.2e} rel)",
              f"attention bandwidth: {res['attention_bandwidth_TBps']:.2f} TB/s; "
              f"share of the step: {res['attention_share_of_step']:.0%}", ""]
    for k, v in res["targets"].items():
        lines.append(f"- {k}: {v['value']:.3f} -> {'met' if v['met'] else 'NOT met'}")
    (out / "runner_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
