"""Sampled decode steps against greedy ones: transformers models served by mstar, batch 64, decode
steps replayed from CUDA graphs with the tokens drawn inside the graph (the engine's sampler), in
the same process.

Models: a random-weight model of SmolLM2-135M's shape (vocabulary 49152) and of Llama-3.2-1B's
(vocabulary 128256: the widest sort), bf16, FlashInfer. Per model, one engine per sampler (its
filters decide what each step computes: top-k and top-p sort the vocabulary) beside a greedy one:

- ``temperature`` (T 0.8), ``min_p_penalty`` (T 0.8, min-p 0.05, repetition penalty 1.1),
  ``top_p`` (T 0.8, top-p 0.95), ``top_k_top_p`` (T 0.7, top-k 50, top-p 0.9), ``all`` (T 0.8,
  top-k 50, top-p 0.9, min-p 0.05, repetition penalty 1.1);
- the decode step: the median wall interval between consecutive 64-row decode steps of a run
  (context 64 + up to 128 new tokens), for greedy and each sampler;
- the bucket-64 graph's GPU time, greedy and sampled replayed in alternating rounds
  (``timing.paired_ms``);
- uncompiled steps for every sampler, and compiled (Inductor) greedy against ``temperature``,
  ``min_p_penalty`` and ``all``.

Target: a sampled step <= 1.05x the greedy step.

    python3 bench/sampled_decode.py --out $OUT
    python3 bench/sampled_decode.py --smoke     # CPU, reference backend: the script only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import report
import torch
from compiled_decode import random_model

from mstar_core import Engine, EngineOptions
from mstar_core.integrations.transformers import run
from mstar_core.sampling import FILTERS, SamplingParams
from mstar_core.testing.timing import paired_ms, sync

CONFIGS: dict[str, SamplingParams] = {
    "temperature": SamplingParams(temperature=0.8),
    "min_p_penalty": SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1),
    "top_p": SamplingParams(temperature=0.8, top_p=0.95),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    "all": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
}
TARGET = 1.05


def engine(model, a, sampler: tuple[str, ...] | None, compile_: bool) -> Engine:
    pages = a.batch * (-(-(a.context + a.new + 16) // 16)) + 2 * a.batch
    o = EngineOptions(max_pages=pages, max_batch_size=a.batch, buckets=(a.batch,), graphs=True, sampler=sampler,
                      compile=compile_)
    return Engine(model, a.backend, o)


def step_ms(e: Engine, prompts: list[list[int]], new: int, params: SamplingParams | None) -> dict:
    """Median interval between consecutive full-batch decode steps, after a warm-up run."""
    sampling = None if params is None else [SamplingParams(**{**params.__dict__, "seed": i})
                                            for i in range(len(prompts))]
    run(e, prompts, 8, sampling=sampling, eos_token_id=None)
    sync(e.device)
    rep = run(e, prompts, new, sampling=sampling, eos_token_id=None)
    steps = rep.decode_step_ms()
    return {"decode_step_ms": statistics.median(steps), "decode_steps_timed": len(steps),
            "replayed_steps": sum(1 for s in rep.steps if s.graph), "ids": rep.ids}


def replay(e: Engine, batch: int):
    g = e.runner._graphs.get((batch, 0))  # noqa: SLF001
    return None if g is None else g.replay


def against_greedy(model, a, prompts, greedy: Engine, base: dict, config: str, compile_: bool) -> dict:
    """One sampler's engine beside the greedy one: step times, the greedy step again, the graphs
    paired, and how many tokens drawn equal greedy's."""
    params = CONFIGS[config]
    filters = FILTERS if config == "all" else tuple(sorted(params.filters()))
    with engine(model, a, filters, compile_) as sampled:
        got = step_ms(sampled, prompts, a.new, params)
        again = step_ms(greedy, prompts, a.new, None)
        out = {k: v for k, v in got.items() if k != "ids"}
        out["greedy_step_ms"] = (base["decode_step_ms"] + again["decode_step_ms"]) / 2  # before and after
        out["step_ratio"] = out["decode_step_ms"] / out["greedy_step_ms"]
        same = sum(x == y for p, q in zip(got["ids"], base["ids"], strict=True) for x, y in zip(p, q, strict=False))
        out["tokens_equal_to_greedy"] = same / max(sum(len(p) for p in got["ids"]), 1)
        fg, fs = replay(greedy, a.batch), replay(sampled, a.batch)
        if greedy.device.type == "cuda" and fg is not None and fs is not None:
            g_ms, s_ms = paired_ms(fg, fs, reps=10, rounds=9)
            out.update(graph_greedy_ms=g_ms, graph_sampled_ms=s_ms, graph_ratio=s_ms / g_ms)
        return out


def measure(name: str, model, a, prompts: list[list[int]]) -> dict:
    r: dict = {}
    modes = [("eager", False, list(CONFIGS))]
    if a.compiled:
        modes.append(("compiled", True, ["temperature", "min_p_penalty", "all"]))
    for mode, compile_, configs in modes:
        with engine(model, a, None, compile_) as greedy:
            base = step_ms(greedy, prompts, a.new, None)
            r[f"{mode}/greedy"] = {k: v for k, v in base.items() if k != "ids"}
            for c in configs:
                t0 = time.perf_counter()
                try:
                    r[f"{mode}/{c}"] = against_greedy(model, a, prompts, greedy, base, c, compile_)
                except Exception as e:  # one part's failure is a result; the others still run
                    r[f"{mode}/{c}"] = {"error": f"{type(e).__name__}: {e}"[:800]}
                    traceback.print_exc()
                print(json.dumps({name: {f"{mode}/{c}": r[f"{mode}/{c}"]}, "s": round(time.perf_counter() - t0, 1)}),
                      flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2_shape,llama1b", help="smollm2_shape, llama1b")
    p.add_argument("--backend", default="flashinfer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                   help="also compiled steps (Inductor): greedy against every filter")
    p.add_argument("--smoke", action="store_true", help="CPU, reference backend, small sizes (checks the script)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.backend, a.batch, a.context, a.new, a.compiled = "cpu", "reference", 4, 16, 8, False
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    res: dict = {"env": report.environment("transformers"),
                 "workload": {k: getattr(a, k) for k in ("batch", "context", "new", "backend", "compiled")},
                 "configs": {k: v.__dict__ for k, v in CONFIGS.items()}}
    print(json.dumps(res), flush=True)
    g = torch.Generator().manual_seed(1)
    for name in a.models.split(","):
        def part(name: str = name) -> dict:
            model = random_model(name, a, dtype)
            prompts = [torch.randint(0, model.config.vocab_size, (a.context,), generator=g).tolist()
                       for _ in range(a.batch)]
            return measure(name, model, a, prompts)

        report.measured(res, name, part)
    return report.finish(a.out, "sampled_decode", res, "Sampled decode steps against greedy ones (tokens drawn "
                         "inside the captured step)", summary(res))


def summary(res: dict) -> list[str]:
    t = res.setdefault("targets", {})
    w = res["workload"]
    lines = [f"Batch {w['batch']}, context {w['context']} + up to {w['new']} new tokens, backend {w['backend']}; "
             "step: median wall interval between decode steps; graph: the bucket's CUDA graph replayed, greedy and "
             "sampled in alternating rounds.", ""]
    rows = []
    for name in ("smollm2_shape", "llama1b"):
        r = res.get(name) or {}
        for key, v in r.items():
            if not isinstance(v, dict) or key.endswith("/greedy"):
                continue
            if "step_ratio" not in v:
                rows.append((name, key, v.get("error", "not measured"), None, None, None, None, None))
                continue
            rows.append((name, key, v["greedy_step_ms"], v["decode_step_ms"], v["step_ratio"],
                         v.get("graph_greedy_ms"), v.get("graph_sampled_ms"), v.get("graph_ratio")))
            ratio = v["step_ratio"]
            t[f"{name} {key}: sampled step / greedy step"] = report.target(ratio, f"<= {TARGET}", ratio <= TARGET)
    lines += report.table(("model", "mode/sampler", "greedy step ms", "sampled step ms", "ratio", "graph greedy ms",
                           "graph sampled ms", "graph ratio"), rows, ".4g")
    return [*lines, "", *report.targets_table(t)]


if __name__ == "__main__":
    raise SystemExit(main())
