"""mstar's generate on a CPU at three intra-op thread counts: 1, every CPU this process may use
(torch's own default on a machine without hyperthreads; recorded beside it), and the count
``mstar generate`` picks by default (``mstar_core.threads``: the cores free of other processes'
load), on an idle machine and on one where another process keeps a core busy.

The model is SmolLM2-135M-Instruct's GGUF file (``--gguf PATH``) or, by default (offline), random
weights of its shape (``cpu_generate.py``'s), float32, the reference backend with graphs off (the
CPU default). ``--batch`` prompts (4) of ``--prompt-len`` random token ids (32), ``--new`` greedy
tokens each (32), as ``mstar generate`` runs them (``generate_report``).

Each machine state in turn: idle, then busy (this script starts one spinning Python process, not
pinned, and stops it after, also on failure). In each, the default is chosen as the CLI chooses it
(``OMP_NUM_THREADS`` aside) once the state holds, then the three counts run in alternating rounds
(``timing.paired_host_us``: one untimed round each, then ``--rounds``). Figures: the decode step
(median over rounds of each call's median steady decode-step interval), the whole call's tokens/s,
the load (the default's reading of busy cores, the load average). Targets: on the busy machine the
default's decode step >= 2x faster than all cores'; on the idle machine within 1.1x the faster of
1 and all cores. Identical greedy ids at every count (asserted).

    python3 bench/cpu_threads.py --out results/cpu                              # random weights
    python3 bench/cpu_threads.py --gguf DIR/SmolLM2-135M-Instruct.Q4_1.gguf --out results/cpu
    python3 bench/cpu_threads.py --smoke                                        # 2 layers: the script only
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import report
import torch
from cpu_generate import from_gguf, smollm2_shape

from mstar_core import threads
from mstar_core.integrations.transformers import generate_report
from mstar_core.testing import timing

CPU = torch.device("cpu")
# A spinner that ends itself once its parent is gone: a killed benchmark leaves no busy core behind.
SPIN = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(1_000_000): pass\n"
SETTLE_S = 0.5  # the spinner's start-up, before the load is read


@contextmanager
def busy_process(on: bool) -> Iterator[subprocess.Popen | None]:
    """One spinning Python process for the duration (``on``), stopped after whatever happens."""
    if not on:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL)
    try:
        time.sleep(SETTLE_S)
        if proc.poll() is not None:
            raise RuntimeError(f"the busy process exited at once (status {proc.returncode})")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def state(model: Any, prompts: list[list[int]], new: int, rounds: int, all_cores: int, busy: bool) -> dict:
    """One machine state: the default chosen there, then the three counts in alternating rounds."""
    with busy_process(busy) as proc:
        load_start = os.getloadavg()
        reading = threads.read_machine()
        chosen = threads.choose(environ={}, reading=reading)
        counts = {"1": 1, "all": all_cores, "default": chosen.count}
        reps: dict[str, list[Any]] = {k: [] for k in counts}

        def call(name: str) -> None:
            torch.set_num_threads(counts[name])
            reps[name].append(generate_report(model, prompts, new, "reference", eos_token_id=None))

        fns = [lambda name=name: call(name) for name in counts]
        with torch.inference_mode():
            wall_us = timing.paired_host_us(fns, reps=rounds, device=CPU)
        alive = proc is None or proc.poll() is None
        load_end = os.getloadavg()
    out: dict[str, Any] = {
        "busy_process": busy, "busy_process_ran_throughout": alive, "load_avg_start": load_start,
        "load_avg_end": load_end, "reading": dict(zip(("cpus", "busy", "quota", "physical"), reading, strict=True)),
        "default": {"count": chosen.count, "why": chosen.why}, "counts": counts, "results": {},
    }
    tokens = len(prompts) * new
    for (name, rs), us in zip(reps.items(), wall_us, strict=True):
        timed = rs[1:]  # the first call of each is paired_host_us's untimed warm-up
        steps = [statistics.median(r.decode_step_ms()) for r in timed if r.decode_step_ms()]
        out["results"][name] = {
            "threads": counts[name], "decode_step_ms": statistics.median(steps) if steps else math.nan,
            "wall_s": us * 1e-6, "tokens_per_s": tokens / (us * 1e-6), "decode_steps_per_call": len(steps),
        }
    out["ids_identical"] = len({str(r.ids) for rs in reps.values() for r in rs}) == 1
    out["ids"] = reps["1"][0].ids
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", help="SmolLM2-135M-Instruct's GGUF file (default: random weights of its shape)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--name", default=None, help="file stem (default cpu_threads-random or cpu_threads-gguf)")
    p.add_argument("--smoke", action="store_true", help="2 layers, 2 prompts of 8, 6 tokens, 1 round")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default $OUT; none: print)")
    a = p.parse_args(argv)
    if a.smoke:
        a.gguf, a.batch, a.prompt_len, a.new, a.rounds = None, 2, 8, 6, 1
    torch_default = torch.get_num_threads()  # before any count is set: torch's own (or $OMP_NUM_THREADS's)
    all_cores = len(threads.affinity())
    model = from_gguf(a.gguf) if a.gguf else smollm2_shape(2 if a.smoke else 30)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    res: dict[str, Any] = {
        "env": report.environment("transformers", "gguf"), "model": a.gguf or "random weights, SmolLM2-135M's shape",
        "torch_default_threads": torch_default, "all_cores": all_cores,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "workload": {"batch": a.batch, "prompt_len": a.prompt_len, "new": a.new, "rounds": a.rounds,
                     "dtype": "float32", "layers": model.config.num_hidden_layers},
    }
    res["idle"] = idle = state(model, prompts, a.new, a.rounds, all_cores, busy=False)
    res["busy"] = busy = state(model, prompts, a.new, a.rounds, all_cores, busy=True)
    same = idle["ids_identical"] and busy["ids_identical"] and idle.pop("ids") == busy.pop("ids")
    res["greedy_ids_identical"] = same
    step = {s: {k: v["decode_step_ms"] for k, v in r["results"].items()} for s, r in (("idle", idle), ("busy", busy))}
    speedup = step["busy"]["all"] / step["busy"]["default"]
    idle_ratio = step["idle"]["default"] / min(step["idle"]["1"], step["idle"]["all"])
    res["targets"] = {
        "busy machine: decode step at all cores / at the default": report.target(speedup, ">= 2.0", speedup >= 2.0),
        "idle machine: decode step at the default / the faster of 1 and all cores":
            report.target(idle_ratio, "<= 1.1", idle_ratio <= 1.1),
        "greedy ids identical at every count": report.target(same, "identical", same),
    }
    body = [f"{a.batch} prompts of {a.prompt_len} random tokens, {a.new} new tokens each, float32, mstar's "
            f"generate (reference backend); medians of {a.rounds} alternating rounds after one untimed round each. "
            f"Torch's own default here: {torch_default} threads; {all_cores} cores in this process's affinity set "
            f"(OMP_NUM_THREADS {res['omp_num_threads'] or 'unset'}).", ""]
    for s, r in (("idle", idle), ("busy", busy)):
        what = "one spinning process started here" if r["busy_process"] else "no process started here"
        others = r["reading"]["busy"] - (1 if r["busy_process"] else 0) if r["reading"]["busy"] is not None else 0
        # a shared host's own load makes "idle" a misnomer: the page says so rather than hiding it
        note = f" Not quiet: {others:.1f} cores were busy with other work." if others >= 0.5 else ""
        body += [f"## {s.capitalize()} machine ({what})", "",
                 f"Default: threads: {r['default']['count']} ({r['default']['why']}). Load average "
                 f"{r['load_avg_start'][0]:.2f} at the start, {r['load_avg_end'][0]:.2f} at the end.{note}", "",
                 *report.table(("threads", "count", "decode step, ms", "tokens/s (whole call)", "whole call, s"),
                               ((k, v["threads"], v["decode_step_ms"], v["tokens_per_s"], v["wall_s"])
                                for k, v in r["results"].items())), ""]
    body += report.targets_table(res["targets"])
    title = f"mstar generate on a CPU at 1, all and the default thread count, idle and busy ({res['model']})"
    report.finish(a.out, a.name or ("cpu_threads-gguf" if a.gguf else "cpu_threads-random"), res, title, body)
    assert same, "greedy ids differ between thread counts"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
