"""Does ``mstar warmup`` leave nothing to compile? On the GPU, in three processes:

1. ``mstar warmup --backend flashinfer ... --json`` for one configuration (timed: what it compiled
   or loaded, per variant);
2. a fresh process: the first plan + run of every FlashInfer wrapper for that configuration, the
   way an engine meets them (prefill with short and long prompts, decode, mixed, ragged), each
   timed, and the modules FlashInfer built meanwhile (its JIT folder before and after) -- expected:
   none;
3. the same once more, to show the load time alone.

    python3 bench/warmup_check.py --out $OUT [--window 128]

Writes warmup_check.json and warmup_check.md into --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CONFIG = ["--dtype", "bfloat16", "--head-dim", "128", "--page-size", "16", "--qo-heads", "32", "--kv-heads", "8"]


def first_use(windows: list[int]) -> dict:
    """In this (fresh) process: the first plan + run of each wrapper, timed."""
    import torch

    from mstar_core.warmup import WarmupConfig
    from mstar_flashinfer import jit_notice
    from mstar_flashinfer.warmup import _Run

    cfg = WarmupConfig(torch.bfloat16, 128, 16, 32, 8, tuple(windows))
    d = jit_notice.jit_dir()
    r = _Run(cfg, torch.device("cuda"))
    steps = []
    for w in cfg.windows:
        for name, fn in (("paged prefill, short prompts", lambda: r.paged_prefill(w, "short")),
                         ("paged prefill, long prompts", lambda: r.paged_prefill(w, "long")),
                         ("paged decode", lambda: r.paged_decode(w)),
                         ("mixed", lambda: r.mixed(w, "long")),
                         ("ragged prefill", lambda: r.prefixed_ragged(w, "long"))):
            before = jit_notice.built_modules(d)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            steps.append({"step": name, "window_left": w, "seconds": time.perf_counter() - t0,
                          "built": sorted(jit_notice.built_modules(d) - before)})
    return {"jit_dir": str(d), "steps": steps, "total_seconds": sum(s["seconds"] for s in steps),
            "modules_built": sum(len(s["built"]) for s in steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, action="append", help="window_left values besides -1")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    windows = [-1] + [w for w in (args.window or []) if w != -1]
    if args.child:
        print(json.dumps(first_use(windows)))
        return
    import flashinfer
    import torch

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "flashinfer": flashinfer.__version__, "python": sys.version.split()[0], "windows": windows}
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
        child = [sys.executable, __file__, "--out", str(args.out), "--child", *[a for w in windows[1:] for a in ("--window", str(w))]]
        c = subprocess.run(child, capture_output=True, text=True, check=True)
        runs.append(json.loads(c.stdout.splitlines()[-1]))
    res = {"meta": meta, "warmup": warm, "first_use_after_warmup": runs[0], "second_process": runs[1]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "warmup_check.json").write_text(json.dumps(res, indent=2))
    lines = [f"# mstar warmup, then a first plan + run -- {meta['device']}", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}, flashinfer {meta['flashinfer']}; bf16, 32/8 heads, "
             f"head_dim 128, page 16, windows {windows}.", "",
             f"`mstar warmup`: {warm['seconds']:.1f} s in its kernels ({wall:.1f} s for the whole command).", "",
             "| variant | seconds | what happened |", "| --- | --- | --- |"]
    lines += [f"| {k['capability']} [{k['variant']}] | {k['seconds']:.2f} | {k['detail']} |" for k in warm["kernels"]]
    for title, run in (("First plan + run in a new process after the warm-up", runs[0]),
                       ("The same in one more process", runs[1])):
        lines += ["", f"{title}: {run['total_seconds']:.2f} s in all, {run['modules_built']} modules built.", "",
                  "| step | window_left | seconds | modules built |", "| --- | --- | --- | --- |"]
        lines += [f"| {s['step']} | {s['window_left']} | {s['seconds']:.3f} | {len(s['built'])} |" for s in run["steps"]]
    (args.out / "warmup_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
