"""mstar's FlashInfer wrappers against raw FlashInfer calls, in one process on one GPU.

    python3 bench/flashinfer_wrappers.py --out $OUT

Writes flashinfer_wrappers.json and .md into --out. Kernels: CUDA-event medians, wrapper and raw
timed in alternating rounds; plan(): host-time medians, alternating, the GPU idle before each.
A wrapper's plan is timed two ways: ``plan(plan_object)`` (contract 2.0, what the managers call;
the PagedPlan/RaggedPlan built once, outside the timed call) and the loose ``plan(arrays...)``
(which builds that plan with the core's checks on every call).
Targets: kernel time through the wrapper <= 1.03x raw; wrapper plan(plan_object) <= raw plan() +
50 us (the loose plan's overhead is reported beside it);
graph-replayed decode at 64 x 8192 >= 90% of the device-to-device copy bandwidth measured here;
the mixed wrapper (a decode plan over the decode rows and a prefill plan over the prompts) plans
faster than one packed prefill plan over all rows. bf16, 32 query / 8 KV heads, head dim 128,
page size 16.
"""

from __future__ import annotations

import argparse
import json

import report
import torch
from paged import BF16, DEV, HKV, HQ, PS, D, paged_layout, uniform_layout, workspace

from mstar_core.plugin import paged_plan, ragged_plan
from mstar_core.testing.timing import copy_bandwidth, host_us, kernel_ms, paired_host_us, paired_ms

KERNEL_RATIO, PLAN_OVERHEAD_US, COPY_FRACTION = 1.03, 50.0, 0.90


def paired(r: dict, raw_plan, w_plan, w_loose_plan, raw_run, w_run, reps: int = 10) -> dict:
    """Plans then kernels, raw and wrapper alternating; the ratios the targets hold. ``w_plan``:
    the wrapper planned with a plan object (2.0), ``w_loose_plan`` with the loose arguments."""
    r["raw_plan_us"], r["plan_us"], r["loose_plan_us"] = paired_host_us([raw_plan, w_plan, w_loose_plan])
    raw_plan()
    w_plan()
    r["raw_ms"], r["ms"] = paired_ms(raw_run, w_run, reps=reps)
    r["kernel_ratio"] = r["ms"] / r["raw_ms"]
    r["plan_overhead_us"] = r["plan_us"] - r["raw_plan_us"]
    r["loose_plan_overhead_us"] = r["loose_plan_us"] - r["raw_plan_us"]
    return r


def bench_decode(fi, cache, rows: int, kv_len: int, results: list, copy_tb_per_s: float | None = None) -> None:
    from mstar_flashinfer.decode import FlashInferDecodeWrapper, use_tensor_cores

    lay = uniform_layout(rows, kv_len, 1)
    layer = cache[: lay["pages"]]
    q = torch.randn(rows, HQ, D, device=DEV, dtype=BF16)
    tc = use_tensor_cores(HQ, HKV)
    raw = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=tc)
    w = FlashInferDecodeWrapper(workspace(), HQ, HKV, D, PS, device=DEV)
    # out= on both sides (the wrapper passes one): FlashInfer 0.7 zero-fills an output it allocates
    raw_out = torch.empty_like(q)
    plan = paged_plan("paged_decode", None, lay["kv_indptr"], lay["kv_indices"], lay["last"], PS, BF16,
                      kv_lens=lay["kv_lens"])
    r = paired({"workload": f"paged decode {rows}x{kv_len}", "use_tensor_cores": tc},
               lambda: raw.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS,
                                q_data_type=BF16, kv_data_type=BF16),
               lambda: w.plan(plan),
               lambda: w.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], dtype=BF16, kv_lens=lay["kv_lens"]),
               lambda: raw.run(q, layer, out=raw_out), lambda: w.run(q, layer))
    kv_bytes = rows * kv_len * HKV * D * 2 * 2
    r["tb_per_s"] = kv_bytes / (r["ms"] * 1e-3) / 1e12
    results.append(r)
    if copy_tb_per_s is None:
        return
    g = FlashInferDecodeWrapper(workspace(), HQ, HKV, D, PS, batch_size=rows, max_num_pages=lay["pages"], device=DEV,
                                accelerator_graph=True)

    def g_plan():
        g.plan(plan)

    g_plan()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.run(q, layer)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.run(q, layer)
    gr = {"workload": f"paged decode {rows}x{kv_len}, CUDA graph replay", "plan_us": host_us(g_plan)}
    g_plan()
    gr["ms"] = kernel_ms(graph.replay)
    gr["tb_per_s"] = kv_bytes / (gr["ms"] * 1e-3) / 1e12
    gr["fraction_of_copy"] = gr["tb_per_s"] / copy_tb_per_s
    results.append(gr)


def bench_prefill(fi, cache, rows: int, q_len: int, results: list) -> None:
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    lay = uniform_layout(rows, q_len, q_len)
    layer = cache[: lay["pages"]]
    q = torch.randn(rows * q_len, HQ, D, device=DEV, dtype=BF16)
    raw = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    w = FlashInferPrefillWrapper(workspace(), HQ, HKV, D, PS, device=DEV)
    raw_out = torch.empty_like(q)
    plan = paged_plan("paged_prefill", lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["last"], PS, BF16,
                      kv_lens=lay["kv_lens"])
    r = paired({"workload": f"paged prefill causal {rows}x{q_len}"},
               lambda: raw.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS,
                                causal=True, q_data_type=BF16, kv_data_type=BF16),
               lambda: w.plan(plan),
               lambda: w.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["last"], causal=True,
                              dtype=BF16, kv_lens=lay["kv_lens"]),
               lambda: raw.run(q, layer, out=raw_out), lambda: w.run(q, layer), reps=5)
    r["tflop_per_s"] = rows * 2 * q_len * q_len * HQ * D / (r["ms"] * 1e-3) / 1e12  # causal: half of 4*L^2*H*D
    results.append(r)


def bench_ragged(fi, results: list, segs: int = 4, prefix: int = 256, fresh: int = 4096) -> None:
    from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

    cu_q = torch.arange(segs + 1, dtype=torch.int32) * fresh
    cu_k = torch.arange(segs + 1, dtype=torch.int32) * (prefix + fresh)
    q = torch.randn(segs * fresh, HQ, D, device=DEV, dtype=BF16)
    k = torch.randn(segs * (prefix + fresh), HKV, D, device=DEV, dtype=BF16)
    v = torch.randn_like(k)
    raw = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD")
    w = FlashInferPrefixedPrefillWrapper(HQ, HKV, D, DEV)
    plan = ragged_plan(cu_q, cu_k, fresh, prefix + fresh, BF16, causal=False)
    r = paired({"workload": f"ragged prefill {segs}x({prefix}+{fresh}) not causal"},
               lambda: raw.plan(cu_q, cu_k, HQ, HKV, D, causal=False, q_data_type=BF16, kv_data_type=BF16),
               lambda: w.plan(plan),
               lambda: w.plan(cu_q, cu_k, fresh, prefix + fresh, causal=False, dtype=BF16),
               lambda: raw.run(q, k, v), lambda: w.run(q, k, v), reps=5)
    r["tflop_per_s"] = segs * 4 * fresh * (prefix + fresh) * HQ * D / (r["ms"] * 1e-3) / 1e12
    results.append(r)


def bench_mixed(fi, cache, results: list, rows: int = 256, prompts: int = 8, prompt_len: int = 512,
                ctx: int = 2048) -> None:
    """The mixed wrapper's two plans against one packed prefill plan over all rows."""
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    q_lens = [prompt_len if i % (rows // prompts) == 0 else 1 for i in range(rows)]
    lay = paged_layout(q_lens, [prompt_len if n > 1 else ctx for n in q_lens], seed=1)
    qo, indptr, indices, last, lens = (lay[k] for k in ("qo_indptr", "kv_indptr", "kv_indices", "last", "kv_lens"))
    tokens = int(qo[-1])
    layer = cache[: lay["pages"]]
    q = torch.randn(tokens, HQ, D, device=DEV, dtype=BF16)
    m = FlashInferMixedWrapper(workspace(), workspace(), HQ, HKV, D, PS, rows, tokens, lay["pages"], prompts, DEV)
    raw = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    p = FlashInferPrefillWrapper(workspace(), HQ, HKV, D, PS, device=DEV)

    plan = paged_plan("mixed", qo, indptr, indices, last, PS, BF16, kv_lens=lens)

    def m_plan():
        m.plan(plan)

    def raw_plan():
        raw.plan(qo, indptr, indices, last, HQ, HKV, D, PS, causal=True, q_data_type=BF16, kv_data_type=BF16)

    r = {"workload": f"mixed {rows} rows ({prompts} prompts of {prompt_len}, {rows - prompts} decode at {ctx})",
         "plan_us": host_us(m_plan), "packed_raw_plan_us": host_us(raw_plan),
         "packed_wrapper_plan_us": host_us(lambda: p.plan(qo, indptr, indices, last, causal=True, dtype=BF16,
                                                           kv_lens=lens))}
    m_plan()
    raw_plan()
    r["ms"] = kernel_ms(lambda: m.run(q, layer), reps=5)
    raw_out = torch.empty_like(q)
    r["packed_raw_ms"] = kernel_ms(lambda: raw.run(q, layer, out=raw_out), reps=5)
    r["plan_vs_packed"] = r["plan_us"] / r["packed_raw_plan_us"]
    results.append(r)


def targets(results: list[dict]) -> dict:
    t = {}
    for r in results:
        w = r["workload"]
        if "error" in r:
            t[f"{w}: ran"] = report.target(None, "no error", False)
        if "kernel_ratio" in r:
            t[f"{w}: kernel / raw"] = report.target(r["kernel_ratio"], f"<= {KERNEL_RATIO}",
                                                    r["kernel_ratio"] <= KERNEL_RATIO)
            t[f"{w}: plan(plan object) - raw plan (us)"] = report.target(
                r["plan_overhead_us"], f"<= {PLAN_OVERHEAD_US:g}", r["plan_overhead_us"] <= PLAN_OVERHEAD_US)
        if "fraction_of_copy" in r:
            t[f"{w}: fraction of copy bandwidth"] = report.target(r["fraction_of_copy"], f">= {COPY_FRACTION}",
                                                                  r["fraction_of_copy"] >= COPY_FRACTION)
        if "plan_vs_packed" in r:
            t[f"{w}: mixed plan / packed prefill plan"] = report.target(r["plan_vs_packed"], "< 1",
                                                                        r["plan_vs_packed"] < 1)
    return t


def page(doc: dict) -> list[str]:
    cols = ("ms", "raw_ms", "kernel_ratio", "plan_us", "raw_plan_us", "plan_overhead_us", "loose_plan_us",
            "loose_plan_overhead_us", "tb_per_s", "tflop_per_s", "fraction_of_copy", "packed_raw_plan_us",
            "packed_wrapper_plan_us", "packed_raw_ms")
    return [f"# FlashInfer wrappers vs raw FlashInfer -- {doc['env']['device']}", "",
            report.environment_line(doc["env"]),
            "", f"bf16, {HQ} q heads / {HKV} kv heads, head_dim {D}, page {PS}. Medians. plan_us: the wrapper "
            "planned with a plan object (contract 2.0, built outside the timed call); loose_plan_us: with the "
            "loose arguments (the core's plan checks on every call). Device-to-device copy, "
            f"4 GiB: {doc['copy']['tb_per_s']:.2f} TB/s (read + write).", "",
            *report.table(("workload", *cols, "error"),
                          ([r["workload"], *(r.get(c) for c in cols), r.get("error")] for r in doc["results"])),
            "", *report.targets_table(doc["targets"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import flashinfer as fi

    torch.manual_seed(0)
    doc: dict = {"env": report.environment(), "copy": copy_bandwidth(),
                 "shape": {"qo_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PS, "dtype": "bfloat16"}}
    # one cache big enough for 64 x 8192 (= 256 x 2048) tokens: 2 GiB in bf16
    cache = torch.randn(64 * 8192 // PS + 1, 2, PS, HKV, D, device=DEV, dtype=BF16)
    results: list[dict] = []
    for name, fn in [
        ("decode 64x8192", lambda: bench_decode(fi, cache, 64, 8192, results, doc["copy"]["tb_per_s"])),
        ("decode 256x2048", lambda: bench_decode(fi, cache, 256, 2048, results)),
        ("prefill 8x4096", lambda: bench_prefill(fi, cache, 8, 4096, results)),
        ("ragged", lambda: bench_ragged(fi, results)),
        ("mixed", lambda: bench_mixed(fi, cache, results)),
    ]:
        try:
            fn()
        except Exception as e:  # one failing workload must not lose the others' numbers
            results.append({"workload": name, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(results[-1]), flush=True)
    doc["results"] = results
    doc["targets"] = targets(results)
    report.write(args.out, "flashinfer_wrappers", doc, page(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
