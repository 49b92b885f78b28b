"""Tensor parallelism on two GPUs: `mstar bench` at --tp 1 and at --tp 2 (torchrun, NCCL) on a
model whose decode step is memory-bound, eager and with graphs + pre-plan, at batch 8 and 64.

The model: 8 layers of hidden 8192 (MLP 16384), 64 query / 8 KV heads of 128, context 2048,
bf16: 8.9 GB of weights a step at tp 1 (half a rank at tp 2), far more than the KV it reads.
Medians of 50 steps after 5; at tp 2 the slowest rank's, with the step's all-reduces timed alone.
Target: with graphs + pre-plan, tp 2 is faster per step than tp 1.

    python3 bench/tp_scaling.py --out $OUT     # writes tp_scaling.json and .md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import report
import torch

MODEL = ["--layers", "8", "--hidden", "8192", "--qo-heads", "64", "--kv-heads", "8", "--head-dim", "128",
         "--context", "2048", "--steps", "50", "--warmup", "5"]
SMOKE = ["--layers", "2", "--hidden", "64", "--qo-heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--context", "20", "--steps", "3", "--warmup", "1"]
MODES = {"eager": [], "graphs+preplan": ["--graphs", "--preplan"]}
CLI = ["-m", "mstar_core.cli"]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *CLI]


def bench(model: list[str], tp: int, batch: int, mode: str, device: str, timeout: float) -> dict:
    """One `mstar bench --json` run; its JSON, or what went wrong."""
    argv = [sys.executable, *(TORCHRUN if tp > 1 else CLI), "bench", *(["--tp", str(tp)] if tp > 1 else []), *model,
            "--batch", str(batch), "--device", device, "--json", *MODES[mode]]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    out = p.stdout
    if p.returncode or "{" not in out:  # the JSON object is what rank 0 printed; torchrun's lines may surround it
        return {"error": f"exit {p.returncode}: {p.stderr[-1500:]}"}
    return json.loads(out[out.index("{"): out.rindex("}") + 1])


def speedup(runs: list[dict], r: dict) -> float | None:
    """tp 1's median step over ``r``'s, at the same batch and mode (None: either failed)."""
    base = next(x["result"] for x in runs if (x["batch"], x["mode"], x["tp"]) == (r["batch"], r["mode"], 1))
    ok = r["tp"] > 1 and "median_step_ms" in base and "median_step_ms" in r["result"]
    return base["median_step_ms"] / r["result"]["median_step_ms"] if ok else None


def page(doc: dict) -> list[str]:
    rows = [(r["batch"], r["mode"], r["tp"], *(r["result"].get(k) for k in (
        "median_step_ms", "tokens_per_s", "median_host_ms", "gpu_step_ms", "allreduce_ms", "allreduce_share")),
        speedup(doc["runs"], r), r["result"].get("error")) for r in doc["runs"]]
    return ["# Tensor parallelism: --tp 1 against --tp 2", "", report.environment_line(doc["env"]), "",
            f"`mstar bench {' '.join(doc['model'])}` (MLP 2 x hidden), bf16 on CUDA. At tp 2: the slowest rank's "
            "medians; all-reduces alone: the step's all-reduces back to back.", "",
            *report.table(("batch", "mode", "tp", "median step ms", "tokens/s", "host ms", "GPU step ms",
                           "all-reduces alone ms", "share", "speed-up vs tp 1", "error"), rows, spec=".4g"),
            "", *report.targets_table(doc["targets"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (checks the script only)")
    a = ap.parse_args(argv)
    model, device, batches = (SMOKE, "cpu", "2") if a.smoke else (MODEL, a.device, a.batches)
    runs = []
    for batch in (int(b) for b in batches.split(",")):
        for mode in MODES:
            for tp in (1, 2):
                r = bench(model, tp, batch, mode, device, a.timeout)
                runs.append({"batch": batch, "mode": mode, "tp": tp, "result": r})
                print(json.dumps(runs[-1]), flush=True)
    targets = {}
    for r in runs:
        if r["mode"] == "graphs+preplan" and r["tp"] == 2:
            up = speedup(runs, r)
            targets[f"batch {r['batch']}, graphs+preplan: tp 2 speed-up over tp 1"] = report.target(
                up, "> 1", up is not None and up > 1)
    env = report.environment()
    env.update(gpus=torch.cuda.device_count(), nccl=".".join(map(str, torch.cuda.nccl.version()))
               if torch.cuda.is_available() else None)
    doc = {"env": env, "model": model, "runs": runs, "targets": targets}
    report.write(a.out, "tp_scaling", doc, page(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
