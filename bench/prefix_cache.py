"""Prefix caching: 64 requests that share a 2,048-token system prompt, each with 64 tokens of its
own and 128 new tokens, through a transformers model on FlashInfer with decode steps replayed
from CUDA graphs, with the prefix cache and without it, in the same process.

Models: SmolLM2-135M-Instruct's own weights (``--smol DIR`` holding the GGUF file; the prompts
are text), and a random-weight model of its shape (``smollm2_shape``; the prompts are random
ids), bf16. Both engines are open side by side and warmed up on other prompts; each round runs
the workload once on each, the cached one starting from an empty cache (its first request
computes the system prompt, the others find it). Per engine, medians over the rounds:

- prompt tokens computed (prefill), time to first token (median over the requests), the decode
  step (the median wall interval between consecutive 64-row decode steps), the greedy ids;
- the host cost of the lookup: ``match_prefix`` (what the scheduler asks) and ``admit_prefix``
  (the walk, the shared pages and their page-table writes) of one prompt against a cache that
  holds its prefix, per 1,000 prompt tokens.

Targets: prefill tokens with the cache <= 1/10 of without; time to first token >= 5x lower;
decode step <= 1.03x; identical greedy ids.

    python3 bench/prefix_cache.py --smol /tmp/smollm2 --out $OUT
    python3 bench/prefix_cache.py --smoke     # CPU, reference backend, small sizes: the script only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import report
import torch
from compiled_decode import GGUF, load_smollm2, random_model

from mstar_core import Engine, EngineOptions
from mstar_core.integrations.transformers import run
from mstar_core.integrations.transformers.engine import LABEL
from mstar_core.testing.timing import sync

TARGETS = {"prefill": 0.1, "ttft": 5.0, "decode": 1.03}


def text_ids(tok, text: str, n: int) -> list[int]:
    """The first ``n`` token ids of ``text`` repeated until it is long enough."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tok(text, add_special_tokens=False)["input_ids"]
    return ids[:n]


def workload(a, vocab: int, tok, seed: int) -> list[list[int]]:
    """``a.requests`` prompts: one system prompt of ``a.system`` tokens, then ``a.own`` of each."""
    if tok is not None:
        rules = " ".join(f"Rule {i}: answer in plain words, cite source {(i * 7 + seed) % 101}, and never guess."
                         for i in range(400))
        system = text_ids(tok, f"You are a careful assistant. {rules}", a.system)
        return [system + text_ids(tok, f" Question {j} (set {seed}): what does rule {j * 3 + seed} say about "
                                       f"source {j * 11 % 97}? Explain it step by step for a new reader.", a.own)
                for j in range(a.requests)]
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (a.system,), generator=g).tolist()
    return [system + torch.randint(0, vocab, (a.own,), generator=g).tolist() for _ in range(a.requests)]


def engine(model, a, cache: bool) -> Engine:
    per = -(-(a.system + a.own + a.new + 16) // 16)
    o = EngineOptions(max_pages=a.requests * per + 2 * a.requests, max_batch_size=a.requests,
                      buckets=(a.requests,), graphs=a.device == "cuda", prefix_cache=cache)
    return Engine(model, a.backend, o)


def one_run(e: Engine, prompts: list[list[int]], new: int) -> dict:
    if e.prefix_root is not None:
        e.kv.clear_prefix_cache()  # every round starts cold: the first request computes the prefix
    sync(e.device)
    rep = run(e, prompts, new, eos_token_id=None)
    ttft = sorted(rep.first_token_s)
    steps = rep.decode_step_ms()
    return {"prefill_tokens": rep.prefill_tokens, "prompt_tokens": rep.prompt_tokens,
            "cached_tokens": sum(rep.cached_tokens or ()), "hit_rate": rep.prefix_hit_rate,
            "ttft_ms_median": ttft[len(ttft) // 2] * 1e3, "ttft_ms_max": ttft[-1] * 1e3,
            "decode_step_ms": statistics.median(steps) if steps else None, "decode_steps_timed": len(steps),
            "kinds": rep.kinds, "waits": rep.waits, "seconds": rep.seconds,
            "replayed_steps": sum(1 for s in rep.steps if s.graph),
            # the first steps: kind, rows, tokens and when each had run (ms from the run's start)
            "first_steps": [(s.kind, s.rows, s.tokens, round(s.read_s * 1e3, 2)) for s in rep.steps[:4]],
            "ids": rep.ids}


def lookup_cost(e: Engine, prompts: list[list[int]], reps: int) -> dict:
    """The host cost of one prompt's lookup against a cache holding its prefix (the last run's
    pages, idle now), per 1,000 prompt tokens."""
    kv, root = e.kv, e.prefix_root
    assert root is not None
    p = prompts[1]
    found = kv.match_prefix(p, root, LABEL)
    match, admit = [], []
    for i in range(reps):
        t0 = time.perf_counter()
        kv.match_prefix(p, root, LABEL)
        t1 = time.perf_counter()
        e.node.ingest_request(f"lookup{i}")
        t2 = time.perf_counter()
        kv.admit_prefix(f"lookup{i}", LABEL, p, root)
        t3 = time.perf_counter()
        e.node.remove_request(f"lookup{i}")
        match.append(t1 - t0)
        admit.append(t3 - t2)
    per_k = 1e6 * 1000 / len(p)  # us per 1,000 prompt tokens
    return {"prompt_tokens": len(p), "tokens_found": found, "match_us": statistics.median(match) * 1e6,
            "admit_us": statistics.median(admit) * 1e6,
            "match_us_per_1000_tokens": statistics.median(match) * per_k,
            "admit_us_per_1000_tokens": statistics.median(admit) * per_k}


def measure(name: str, model, tok, a) -> dict:
    vocab = model.config.vocab_size
    prompts = workload(a, vocab, tok, seed=1)
    warm = workload(a, vocab, tok, seed=2)  # other prompts: the measured rounds start cold
    r: dict = {"rounds": {"no_cache": [], "cache": []}}
    with engine(model, a, False) as plain, engine(model, a, True) as cached:
        for e in (plain, cached):
            run(e, warm, 8, eos_token_id=None)
        for i in range(a.rounds):
            for key, e in (("no_cache", plain), ("cache", cached)):
                t0 = time.perf_counter()
                got = one_run(e, prompts, a.new)
                r["rounds"][key].append(got)
                print(json.dumps({name: {key: {k: v for k, v in got.items() if k != "ids"}}, "round": i,
                                  "s": round(time.perf_counter() - t0, 2)}), flush=True)
        r["lookup"] = lookup_cost(cached, prompts, a.lookup_reps)
        cached.node.post_warmup_validate()  # the page accounting after every round and lookup
    ids = [x["ids"] for x in r["rounds"]["no_cache"]]
    got = [x["ids"] for x in r["rounds"]["cache"]]
    same = sum(u == v for p, q in zip(ids[0], got[0], strict=True) for u, v in zip(p, q, strict=True))
    r["ids_identical"] = all(g == ids[0] for g in got)
    r["tokens_equal_fraction"] = same / sum(len(p) for p in ids[0])
    r["no_cache_rounds_agree"] = all(x == ids[0] for x in ids)
    r["first_divergence"] = next(([i, next(k for k, (u, v) in enumerate(zip(p, q, strict=True)) if u != v)]
                                  for i, (p, q) in enumerate(zip(ids[0], got[0], strict=True)) if p != q), None)
    for key in ("no_cache", "cache"):
        rounds = r["rounds"][key]
        r[key] = {k: statistics.median(x[k] for x in rounds)
                  for k in ("prefill_tokens", "ttft_ms_median", "ttft_ms_max", "decode_step_ms", "seconds")}
        r[key]["hit_rate"] = rounds[0]["hit_rate"]
        for x in rounds:
            del x["ids"]
    n, c = r["no_cache"], r["cache"]
    r["prefill_ratio"] = c["prefill_tokens"] / n["prefill_tokens"]
    r["ttft_speedup"] = n["ttft_ms_median"] / c["ttft_ms_median"]
    r["decode_ratio"] = c["decode_step_ms"] / n["decode_step_ms"]
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,smollm2_shape", help="smollm2 (needs --smol), smollm2_shape")
    p.add_argument("--smol", default=None, help=f"folder holding {GGUF} (none: SmolLM2's own weights are skipped)")
    p.add_argument("--backend", default="flashinfer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system", type=int, default=2048, help="system prompt tokens, shared by every request")
    p.add_argument("--own", type=int, default=64, help="each request's own prompt tokens")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lookup-reps", type=int, default=200)
    p.add_argument("--smoke", action="store_true", help="CPU, reference backend, small sizes (checks the script)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.backend, a.requests, a.system, a.own, a.new, a.rounds, a.lookup_reps = \
            "cpu", "reference", 4, 64, 8, 6, 1, 5
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    res: dict = {"env": report.environment("transformers"),
                 "workload": {k: getattr(a, k) for k in ("requests", "system", "own", "new", "rounds", "backend")}}
    print(json.dumps(res), flush=True)
    for name in a.models.split(","):
        if name == "smollm2" and not a.smol:
            res[name] = {"error": "not run: no --smol folder"}
            continue
        report.measured(res, name, lambda name=name: measure(name, *load(name, a, dtype), a))
    return report.finish(a.out, "prefix_cache", res, "Prefix caching: requests sharing a system prompt, with the "
                         "cache and without", summary(res))


def load(name: str, a, dtype: torch.dtype):
    """The model and its tokenizer (None for a random-weight model: its prompts are random ids)."""
    if name == "smollm2":
        return load_smollm2(a.smol, dtype, a.device)
    return random_model(name, a, dtype), None


def summary(res: dict) -> list[str]:
    t = res.setdefault("targets", {})
    w = res["workload"]
    lines = [f"{w['requests']} requests: a {w['system']}-token system prompt + {w['own']} tokens each, {w['new']} new "
             f"tokens each, backend {w['backend']}, decode graphs; medians over {w['rounds']} rounds, both engines in "
             "one process. TTFT: median over the requests, from the run's start (every request arrives at once).", ""]
    rows, cost = [], []
    for name in ("smollm2", "smollm2_shape"):
        r = res.get(name) or {}
        if "prefill_ratio" not in r:
            rows.append((name, r.get("error", "not measured"), None, None, None, None, None, None))
            continue
        n, c = r["no_cache"], r["cache"]
        rows.append((name, n["prefill_tokens"], c["prefill_tokens"], n["ttft_ms_median"], c["ttft_ms_median"],
                     n["decode_step_ms"], c["decode_step_ms"], r["tokens_equal_fraction"]))
        lk = r["lookup"]
        cost.append((name, lk["prompt_tokens"], lk["tokens_found"], lk["match_us"], lk["admit_us"],
                     lk["match_us_per_1000_tokens"], lk["admit_us_per_1000_tokens"]))
        t[f"{name}: prefill tokens with / without the cache"] = report.target(
            r["prefill_ratio"], f"<= {TARGETS['prefill']}", r["prefill_ratio"] <= TARGETS["prefill"])
        t[f"{name}: time to first token without / with"] = report.target(
            r["ttft_speedup"], f">= {TARGETS['ttft']}", r["ttft_speedup"] >= TARGETS["ttft"])
        t[f"{name}: decode step with / without"] = report.target(
            r["decode_ratio"], f"<= {TARGETS['decode']}", r["decode_ratio"] <= TARGETS["decode"])
        t[f"{name}: greedy ids identical"] = report.target(
            r["ids_identical"], "all", bool(r["ids_identical"]))
    lines += report.table(("model", "prefill tokens, no cache", "with cache", "TTFT ms, no cache", "with cache",
                           "decode step ms, no cache", "with cache", "tokens equal"), rows, ".4g")
    lines += ["", "Host cost of one prompt's lookup against a cache holding its prefix (median):", ""]
    lines += report.table(("model", "prompt tokens", "found", "match_prefix us", "admit_prefix us",
                           "match us / 1000 tokens", "admit us / 1000 tokens"), cost, ".4g")
    return [*lines, "", *report.targets_table(t)]


if __name__ == "__main__":
    raise SystemExit(main())
