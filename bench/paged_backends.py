"""mstar's two real paged backends, FA3 and FlashInfer, on the same steps, each against its own raw
library call, in one process on one GPU.

    python3 bench/paged_backends.py --out $OUT [--tables DIR] [--commit SHA]

Workloads (bf16, 32 query / 8 KV heads, head dim 128, page size 16): decode 64 x 8192 and
256 x 2048, causal prefill 8 x 4096, a mixed step (256 rows: 8 prompts of 512, the rest decoding
at 2048). For each backend and workload: the wrapper's kernel time and the raw call's (CUDA-event
medians, alternating rounds), their ratio (target <= 1.03), and plan() host time. FA3 also: graph
replay of its decode wrapper; its raw decode with the step's K/V written by the kernel itself
(``flash_attn_with_kvcache(k=, v=)``) against a separate KV write then the raw call; sink logits'
cost. ``--tables DIR`` writes each backend's measured table (``DIR/mstar_<name>/measured.json``,
what auto orders paged backends by) from the wrapper medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

import report
import torch
from paged import BF16, DEV, HKV, HQ, PS, D, paged_layout, uniform_layout, workspace

from mstar_core.testing.timing import host_us, kernel_ms, paired_host_us, paired_ms

KERNEL_RATIO = 1.03
# workload -> (capability, q_lens, kv_lens)
MIXED_Q = [512 if i % 32 == 0 else 1 for i in range(256)]
WORKLOADS = {
    "decode 64x8192": ("paged_decode", [1] * 64, [8192] * 64),
    "decode 256x2048": ("paged_decode", [1] * 256, [2048] * 256),
    "prefill 8x4096": ("paged_prefill", [4096] * 8, [4096] * 8),
    "mixed 256 rows (8 x 512 prompt)": ("mixed", MIXED_Q, [512 if n > 1 else 2048 for n in MIXED_Q]),
}


def _layout(q_lens, kv_lens):
    if len(set(q_lens)) == 1 and len(set(kv_lens)) == 1:
        return uniform_layout(len(q_lens), kv_lens[0], q_lens[0])
    return paged_layout(q_lens, kv_lens, seed=1)


def _page_table(lay) -> torch.Tensor:
    """The raw FA3 call's dense page table [rows, max pages], built once outside the timing."""
    indptr, indices = lay["kv_indptr"].tolist(), lay["kv_indices"]
    rows = len(indptr) - 1
    width = max(indptr[i + 1] - indptr[i] for i in range(rows))
    table = torch.zeros(rows, width, dtype=torch.int32)
    for r in range(rows):
        table[r, : indptr[r + 1] - indptr[r]] = indices[indptr[r]: indptr[r + 1]]
    return table.to(DEV)


def _wrappers(backend: str, cap: str, lay, tokens: int, prompts: int):
    if backend == "fa3":
        from mstar_fa3.paged import FA3DecodeWrapper, FA3MixedWrapper, FA3PrefillWrapper
        classes = {"paged_decode": FA3DecodeWrapper, "paged_prefill": FA3PrefillWrapper, "mixed": FA3MixedWrapper}
    else:
        from mstar_flashinfer.decode import FlashInferDecodeWrapper
        from mstar_flashinfer.mixed import FlashInferMixedWrapper
        from mstar_flashinfer.prefill import FlashInferPrefillWrapper
        classes = {"paged_decode": FlashInferDecodeWrapper, "paged_prefill": FlashInferPrefillWrapper,
                   "mixed": FlashInferMixedWrapper}
    cls = classes[cap]
    if cap == "mixed":
        rows = lay["kv_indptr"].numel() - 1
        return cls(workspace(), workspace(), HQ, HKV, D, PS, rows, tokens, lay["pages"], prompts, DEV)
    return cls(workspace(), HQ, HKV, D, PS, device=DEV)


def _plan(w, cap: str, lay, dev_indices: torch.Tensor) -> None:
    if cap == "paged_decode":
        w.plan(lay["kv_indptr"], dev_indices, lay["last"], dtype=BF16, kv_lens=lay["kv_lens"])
    else:  # the mixed split is host arithmetic: host indices, as the manager passes them
        idx = lay["kv_indices"] if cap == "mixed" else dev_indices
        w.plan(lay["qo_indptr"], lay["kv_indptr"], idx, lay["last"], causal=True, dtype=BF16, kv_lens=lay["kv_lens"])


def _raw(backend: str, cap: str, lay, q: torch.Tensor, layer: torch.Tensor):
    """(plan, run) of the raw library call for this step."""
    if backend == "fa3":
        import flash_attn_interface as fa3
        table, lens = _page_table(lay), lay["kv_lens"].to(DEV)
        k, v = layer[:, 0], layer[:, 1]
        if cap == "paged_decode":
            q4 = q.view(q.shape[0], 1, HQ, D)
            return (lambda: None), (lambda: fa3.flash_attn_with_kvcache(q4, k, v, cache_seqlens=lens, page_table=table,
                                                                       causal=True))
        cu, max_q = lay["qo_indptr"].to(DEV), int((lay["qo_indptr"][1:] - lay["qo_indptr"][:-1]).max())
        return (lambda: None), (lambda: fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table,
                                                                   cu_seqlens_q=cu, max_seqlen_q=max_q, causal=True))
    import flashinfer as fi
    out = torch.empty_like(q)
    if cap == "paged_decode":
        from mstar_flashinfer.decode import use_tensor_cores
        raw = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=use_tensor_cores(HQ, HKV))
        return (lambda: raw.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS, q_data_type=BF16,
                                 kv_data_type=BF16)), (lambda: raw.run(q, layer, out=out))
    raw = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    return (lambda: raw.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS,
                             causal=True, q_data_type=BF16, kv_data_type=BF16)), (lambda: raw.run(q, layer, out=out))


def bench(backend: str, name: str, cache: torch.Tensor) -> dict:
    cap, q_lens, kv_lens = WORKLOADS[name]
    lay = _layout(q_lens, kv_lens)
    layer = cache[: lay["pages"]]
    tokens = sum(q_lens)
    q = torch.randn(tokens, HQ, D, device=DEV, dtype=BF16)
    dev_indices = lay["kv_indices"].to(DEV)
    w = _wrappers(backend, cap, lay, tokens, sum(1 for n in q_lens if n > 1))
    raw_plan, raw_run = _raw(backend, cap, lay, q, layer)
    r: dict = {"backend": backend, "workload": name, "capability": cap}
    r["raw_plan_us"], r["plan_us"] = paired_host_us([raw_plan, lambda: _plan(w, cap, lay, dev_indices)])
    raw_plan()
    _plan(w, cap, lay, dev_indices)
    ref = raw_run()
    got = w.run(q, layer)
    r["max_abs_diff_vs_raw"] = float((got.float() - ref.reshape(got.shape).float()).abs().max())
    r["raw_ms"], r["ms"] = paired_ms(raw_run, lambda: w.run(q, layer), reps=10 if cap == "paged_decode" else 5)
    r["kernel_ratio"] = r["ms"] / r["raw_ms"]
    return r


def graph_decode(cache: torch.Tensor, rows: int, kv_len: int) -> dict:
    """FA3's decode wrapper captured once and replayed after a fresh plan (the graph runner's use)."""
    from mstar_fa3.paged import FA3DecodeWrapper

    lay = uniform_layout(rows, kv_len, 1)
    layer = cache[: lay["pages"]]
    q = torch.randn(rows, HQ, D, device=DEV, dtype=BF16)
    idx = lay["kv_indices"].to(DEV)
    g = FA3DecodeWrapper(workspace(), HQ, HKV, D, PS, batch_size=rows, max_num_pages=lay["pages"] + rows, device=DEV,
                         accelerator_graph=True)

    def plan():
        g.plan(lay["kv_indptr"], idx, lay["last"], dtype=BF16, kv_lens=lay["kv_lens"])

    plan()
    eager = g.run(q, layer).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.run(q, layer)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.run(q, layer)
    out.fill_(float("nan"))
    plan()
    graph.replay()
    torch.cuda.synchronize()
    r = {"backend": "fa3", "workload": f"decode {rows}x{kv_len}, CUDA graph replay", "plan_us": host_us(plan),
         "replay_equals_eager": bool(torch.equal(out, eager))}
    r["ms"] = kernel_ms(graph.replay)
    return r


def kv_write(cache: torch.Tensor, rows: int = 64, kv_len: int = 8192) -> dict:
    """The step's new K/V written by FA3's kernel (k=, v=) against a separate write then the call."""
    import flash_attn_interface as fa3

    lay = uniform_layout(rows, kv_len, 1)
    layer = cache[: lay["pages"]]
    kc, vc = layer[:, 0], layer[:, 1]
    table, lens = _page_table(lay), lay["kv_lens"].to(DEV)
    before = lens - 1
    q = torch.randn(rows, 1, HQ, D, device=DEV, dtype=BF16)
    k_new = torch.randn(rows, 1, HKV, D, device=DEV, dtype=BF16)
    v_new = torch.randn_like(k_new)
    pos = before.long()
    page = table.long().gather(1, (pos // PS)[:, None])[:, 0]
    off = pos % PS

    def fused():
        return fa3.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=before, page_table=table,
                                           causal=True)

    def separate():
        kc[page, off] = k_new[:, 0]
        vc[page, off] = v_new[:, 0]
        return fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True)

    a, b = fused(), separate()
    r = {"backend": "fa3", "workload": f"decode {rows}x{kv_len}: KV write in the kernel vs separate",
         "max_abs_diff": float((a.float() - b.float()).abs().max())}
    r["separate_ms"], r["fused_ms"] = paired_ms(separate, fused, reps=10)
    r["fused_over_separate"] = r["fused_ms"] / r["separate_ms"]
    return r


def sinks_cost(cache: torch.Tensor, rows: int = 64, kv_len: int = 8192) -> dict:
    from mstar_fa3.paged import FA3DecodeWrapper

    lay = uniform_layout(rows, kv_len, 1)
    layer = cache[: lay["pages"]]
    q = torch.randn(rows, HQ, D, device=DEV, dtype=BF16)
    sinks = torch.randn(HQ, device=DEV)
    w = FA3DecodeWrapper(workspace(), HQ, HKV, D, PS, device=DEV)
    w.plan(lay["kv_indptr"], lay["kv_indices"].to(DEV), lay["last"], dtype=BF16, kv_lens=lay["kv_lens"])
    r = {"backend": "fa3", "workload": f"decode {rows}x{kv_len}: sink logits vs none"}
    r["plain_ms"], r["sinks_ms"] = paired_ms(lambda: w.run(q, layer), lambda: w.run(q, layer, sinks=sinks), reps=10)
    r["sinks_over_plain"] = r["sinks_ms"] / r["plain_ms"]
    return r


def tables(results: list[dict], env: dict, source: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in results:
        if "kernel_ratio" not in r:
            continue
        t = out.setdefault(r["backend"], {"backend": r["backend"], "arch": env.get("arch", "sm90"),
                                          "device": env.get("device", ""), "dtype": "bfloat16",
                                          "shape": {"qo_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PS},
                                          "versions": env.get("versions", {}), "source": source, "median_ms": {}})
        t["median_ms"].setdefault(r["capability"], {})[r["workload"]] = round(r["ms"], 5)
    return out


def targets(results: list[dict]) -> dict:
    t = {}
    for r in results:
        if "kernel_ratio" in r:
            t[f"{r['backend']} {r['workload']}: wrapper / raw kernel time"] = report.target(
                r["kernel_ratio"], f"<= {KERNEL_RATIO}", r["kernel_ratio"] <= KERNEL_RATIO)
    for wl in WORKLOADS:
        got = {r["backend"]: r["ms"] for r in results if r.get("workload") == wl and "ms" in r and "kernel_ratio" in r}
        if len(got) == 2:
            t[f"{wl}: faster backend"] = report.target(min(got, key=got.get), "auto's pick (the measured table)", True)
    return t


def page(doc: dict) -> list[str]:
    rows = [(r.get("backend"), r.get("workload"), r.get("ms", r.get("fused_ms")), r.get("raw_ms"),
             r.get("kernel_ratio"), r.get("plan_us"), r.get("error", "")) for r in doc["results"]]
    return ["## Paged backends (FA3, FlashInfer) against their raw calls", "",
            *report.table(["backend", "workload", "ms", "raw ms", "ratio", "plan us", "error"], rows), "",
            "## Targets", "", *report.targets_table(doc["targets"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tables", default=None, help="write each backend's measured.json under this folder")
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--backends", default="fa3,flashinfer")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    env = report.environment()
    cc = torch.cuda.get_device_capability()
    env["arch"] = f"sm{cc[0]}{cc[1]}"
    doc: dict = {"env": env, "commit": args.commit,
                 "shape": {"qo_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PS, "dtype": "bfloat16"}}
    cache = torch.randn(64 * 8192 // PS + 64 + 1, 2, PS, HKV, D, device=DEV, dtype=BF16)
    results: list[dict] = []
    jobs = [(f"{b} {wl}", (lambda b=b, wl=wl: bench(b, wl, cache))) for wl in WORKLOADS
            for b in args.backends.split(",")]
    if "fa3" in args.backends:
        jobs += [("fa3 graph decode", lambda: graph_decode(cache, 64, 8192)), ("fa3 kv write", lambda: kv_write(cache)),
                 ("fa3 sinks", lambda: sinks_cost(cache))]
    for name, fn in jobs:
        try:
            results.append(fn())
        except Exception as e:  # one failing workload must not lose the others' numbers
            traceback.print_exc()
            results.append({"workload": name, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(results[-1]), flush=True)
    doc["results"] = results
    doc["targets"] = targets(results)
    source = f"results/h200/paged_backends/paged_backends-{args.commit}.json"
    doc["tables"] = tables(results, env, source)
    if args.tables:
        for b, t in doc["tables"].items():
            p = Path(args.tables) / f"mstar_{b}" / "measured.json"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(t, indent=1) + "\n")
            print(f"wrote {p}", file=sys.stderr)
    report.write(args.out, f"paged_backends-{args.commit}", doc, page(doc))
    return 0 if all("error" not in r for r in results) and all(
        math.isfinite(r.get("ms", 0.0)) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
