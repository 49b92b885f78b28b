"""Does ``mstar warmup`` leave nothing to compile? On the GPU, in three processes:

1. ``mstar warmup --backend flashinfer ... --json`` for one configuration (timed: what it compiled
   or loaded, per variant);
2. a fresh process: the first plan + run of every FlashInfer wrapper for that configuration, built
   from the conformance suite's data with shapes of their own (prefill with short and long prompts,
   eager and graph-mode decode, a mixed step, ragged), each timed, and the modules FlashInfer built
   meanwhile (its JIT folder before and after) -- expected: none;
3. the same once more, to show the load time alone.

    python3 bench/warmup_first_use.py --out $OUT [--window 128]   # writes warmup_first_use.json and .md

Target: no module built in either fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import report

CONFIG = ["--dtype", "bfloat16", "--head-dim", "128", "--page-size", "16", "--qo-heads", "32", "--kv-heads", "8"]


def first_use(windows: list[int]) -> dict:
    """In this (fresh) process: the first plan + run of each wrapper, the way an engine's steps
    meet them -- built here from the conformance suite's data, with shapes of their own (eager
    prefill with long and short prompts, eager decode, a graph-mode decode bucket, a mixed step,
    a ragged prefill), not the warm-up's own helper -- each timed, and the modules built."""
    import torch
    from paged import workspace as ws

    from mstar_core.testing import conformance as C
    from mstar_flashinfer import jit_notice
    from mstar_flashinfer.decode import FlashInferDecodeWrapper
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper
    from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

    bf16, dev, ps, hkv, gqa, d = torch.bfloat16, torch.device("cuda"), 16, 8, 4, 128
    jit = jit_notice.jit_dir()

    def data(q_lens, prefix, w, seed):
        return C.make_paged(C.PagedCase(ps, d, gqa, q_lens, prefix, window_left=w, num_kv_heads=hkv, seed=seed),
                            "cuda", bf16)

    def prefill(q_lens, prefix, w):
        x = data(q_lens, prefix, w, 1)
        p = FlashInferPrefillWrapper(ws(), hkv * gqa, hkv, d, ps, device=dev)
        p.plan(x.qo_indptr, x.kv_indptr, x.kv_indices, x.last_page_len, dtype=bf16, window_left=w)
        p.run(x.q, x.layer)

    def decode(rows, w, graph):
        x = data((1,) * rows, tuple(range(3, 3 + 37 * rows, 37)), w, 2)
        extra = dict(batch_size=16, max_num_pages=x.layer.shape[0] + 16, accelerator_graph=True) if graph else {}
        dw = FlashInferDecodeWrapper(ws(), hkv * gqa, hkv, d, ps, device=dev, **extra)
        dw.plan(x.kv_indptr, x.kv_indices, x.last_page_len, dtype=bf16, window_left=w)
        q = x.q if not graph else torch.cat([x.q, x.q.new_zeros(16 - rows, *x.q.shape[1:])])
        dw.run(q, x.layer)

    def mixed(w):
        x = data((1, 90, 1, 30), (40, 0, 17, 5), w, 3)
        m = FlashInferMixedWrapper(ws(), ws(), hkv * gqa, hkv, d, ps, 8, 256, x.layer.shape[0], 2, dev)
        m.plan(x.qo_indptr, x.kv_indptr, x.kv_indices, x.last_page_len, dtype=bf16, window_left=w)
        m.run(x.q, x.layer)

    def ragged(w):
        cu_q = torch.tensor([0, 80, 100], dtype=torch.int32)
        cu_k = torch.tensor([0, 120, 150], dtype=torch.int32)
        r = FlashInferPrefixedPrefillWrapper(hkv * gqa, hkv, d, dev, workspace_buffer=ws())
        r.plan(cu_q, cu_k, 80, 120, causal=True, dtype=bf16, window_left=w)
        r.run(torch.randn(100, hkv * gqa, d, device=dev, dtype=bf16), torch.randn(150, hkv, d, device=dev, dtype=bf16),
              torch.randn(150, hkv, d, device=dev, dtype=bf16))

    steps = []
    for w in windows:
        for name, fn in (("paged prefill, prompts of 100 and 7", lambda w=w: prefill((100, 7), (0, 30), w)),
                         ("paged prefill, prompts of 5 and 3", lambda w=w: prefill((5, 3), (12, 0), w)),
                         ("paged decode, 8 rows", lambda w=w: decode(8, w, False)),
                         ("paged decode, graph-mode bucket of 16", lambda w=w: decode(5, w, True)),
                         ("mixed step (prompts of 90 and 30)", lambda w=w: mixed(w)),
                         ("ragged prefill", lambda w=w: ragged(w))):
            new = jit_notice.built_since(jit)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            steps.append({"step": name, "window_left": w, "seconds": time.perf_counter() - t0,
                          "built": sorted(new())})
    return {"jit_dir": str(jit), "steps": steps, "total_seconds": sum(s["seconds"] for s in steps),
            "modules_built": sum(len(s["built"]) for s in steps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, action="append", help="window_left values besides -1")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    windows = [-1] + [w for w in (args.window or []) if w != -1]
    if args.child:
        print(json.dumps(first_use(windows)))
        return 0
    meta = {**report.environment(), "windows": windows}
    win_args = [a for w in windows for a in ("--window", str(w))]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mstar_core.cli", "-v", "warmup", "--backend", "flashinfer", *CONFIG,
                        *win_args, "--json"], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"mstar warmup failed ({p.returncode}):\n{p.stderr[-4000:]}")
    warm = json.loads(p.stdout)
    warm["wall_seconds"] = wall  # the whole command: interpreter, torch and flashinfer imports too
    warm["log"] = p.stderr.splitlines()[-60:]
    runs = []
    for _ in range(2):
        child = [sys.executable, __file__, "--out", str(args.out), "--child",
                 *[a for w in windows[1:] for a in ("--window", str(w))]]
        c = subprocess.run(child, capture_output=True, text=True, check=True)
        runs.append(json.loads(c.stdout.splitlines()[-1]))
    built = sum(r["modules_built"] for r in runs)
    res = {"env": meta, "warmup": warm, "first_use_after_warmup": runs[0], "second_process": runs[1],
           "targets": {"modules built after the warm-up (two fresh processes)": report.target(built, "0", built == 0)}}
    lines = [f"# mstar warmup, then a first plan + run -- {meta['device']}", "", report.environment_line(meta), "",
             f"bf16, 32/8 heads, head_dim 128, page 16, windows {windows}.", "",
             f"`mstar warmup`: {warm['seconds']:.1f} s in its kernels ({wall:.1f} s for the whole command).", "",
             *report.table(("variant", "seconds", "what happened"),
                           ((f"{k['capability']} [{k['variant']}]", k["seconds"], k["detail"])
                            for k in warm["kernels"]),
                           spec=".2f")]
    for title, run in (("First plan + run in a new process after the warm-up", runs[0]),
                       ("The same in one more process", runs[1])):
        lines += ["", f"{title}: {run['total_seconds']:.2f} s in all, {run['modules_built']} modules built.", "",
                  *report.table(("step", "window_left", "seconds", "modules built"),
                                ((s["step"], s["window_left"], s["seconds"], len(s["built"])) for s in run["steps"]),
                                spec=".3f")]
    report.write(args.out, "warmup_first_use", res, [*lines, "", *report.targets_table(res["targets"])])
    return 0 if built == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
