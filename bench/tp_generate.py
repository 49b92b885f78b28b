"""Tensor-parallel generation of transformers models: `mstar generate --tp N` (torchrun; NCCL on
GPUs) against `--tp 1`, and both against transformers' own greedy `generate` on one GPU.

Models:

- ``smollm2``: SmolLM2-135M-Instruct from its GGUF file (``--smol DIR``), loaded whole on every
  rank and sharded by mstar. Its 9 query / 3 KV heads shard over 3 ranks, not 2: with fewer
  than 3 GPUs its ``--tp 2`` refusal is what is recorded.
- ``llama1b``: a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 query / 8 KV heads of
  64, vocabulary 128256, tied embeddings), random bf16 weights saved as safetensors: loaded
  sharded by transformers' tensor parallelism.
- ``llama1b_seed``: the same shape from its config alone (random weights from ``--seed`` on
  every rank): sharded by mstar.

Per model, chat prompts (SmolLM2) or random ids, ``--new`` greedy tokens each, no early stop:

- float32 (the reference backend: FlashInfer takes no float32): ``--tp N``'s ids against
  ``--tp 1``'s. Target: identical.
- bf16 with CUDA graphs (backend auto): ids of both against transformers' own bf16 greedy
  ``generate`` prompt by prompt (identical prompts, mean common prefix), the decode step (the
  median interval between steady decode steps) and tokens/s at both.

    python3 bench/tp_generate.py --smol /tmp/smollm2 --out $OUT   # writes tp_generate.json and .md
    python3 bench/tp_generate.py --smoke --gpus 3                 # CPU, gloo ranks, tiny shapes: the script only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report
import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ("What is a KV cache?", "Name three primary colours.", "Write a haiku about the sea.",
             "Why is the sky blue?", "What does a compiler do?", "Give me a tip for learning to cook.",
             "What is the capital of France?", "Explain recursion in one sentence.")
CLI = ["-m", "mstar_core.cli"]


def llama_config(smoke: bool, **shape):
    import transformers

    base = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2) if smoke else dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16)
    kw = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=64 if not smoke else 4,
              tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192, initializer_range=0.02,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return transformers.LlamaConfig(**{**base, **kw, **shape})


def prepare(name: str, a, work: Path) -> tuple[str, list[list[int]], str]:
    """The model path the CLI loads, its prompts' ids, and how it is sharded."""
    import transformers

    d = work / name
    if name == "smollm2" and not a.smoke:
        from mstar_core.integrations.transformers.local import read_tokenizer, resolve

        tok = read_tokenizer(resolve(os.path.join(a.smol, GGUF)))
        prompts = []
        for q in QUESTIONS:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return os.path.join(a.smol, GGUF), prompts, "mstar (a GGUF file loads whole)"
    if name == "smollm2":  # smoke: a random model of SmolLM2's head layout
        cfg = llama_config(True, num_attention_heads=9, num_key_value_heads=3, hidden_size=144, head_dim=16)
    else:
        cfg = llama_config(a.smoke)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    if not d.exists():
        if name == "llama1b_seed":
            cfg.save_pretrained(d)
        else:
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    how = "mstar (random weights from --seed on every rank)" if name == "llama1b_seed" else \
        "transformers (safetensors, loaded sharded)"
    return str(d), prompts, how


def heads(path: str) -> tuple[int, int]:
    from mstar_core.integrations.transformers.local import read_config, resolve
    from mstar_core.integrations.transformers.parallel import head_counts

    return head_counts(read_config(resolve(path)))


def ranks_for(path: str, gpus: int) -> int | None:
    """The fewest ranks above one, at most ``gpus``, that divide the model's heads."""
    q, kv = heads(path)
    return next((n for n in range(2, gpus + 1) if q % n == 0 and kv % n == 0), None)


def generate(path: str, prompt_file: str, tp: int, dtype: str, a) -> dict:
    """One `mstar generate --json` run: its JSON, or what went wrong."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp), *CLI] if tp > 1 else CLI
    argv = [sys.executable, *launch, "generate", path, "--ids", "--prompt-file", prompt_file, "--max-new-tokens",
            str(a.new), "--ignore-eos", "--dtype", dtype, "--device", a.device, "--json",
            *(["--tp", str(tp)] if tp > 1 else []), *(["--backend", "reference"] if dtype == "float32" else [])]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout, check=False,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.timeout:g} s"}
    out, wall = p.stdout, time.perf_counter() - t0
    if p.returncode or "{" not in out:
        last = [x for x in p.stderr.strip().splitlines() if x.strip()][-3:]
        return {"error": f"exit {p.returncode}: {' | '.join(last)}", "wall_s": wall}
    res = json.loads(out[out.index("{"): out.rindex("}") + 1])
    keep = ("backend", "steps", "graph_steps", "new_tokens", "seconds", "tokens_per_s", "decode_step_ms_median",
            "first_token_s_median", "load_seconds", "sharded_by", "ids")
    return {**{k: res.get(k) for k in keep}, "wall_s": wall}


def hf_greedy(path: str, prompts: list[list[int]], a) -> dict:
    """transformers' own greedy generate, one prompt at a time, bf16 on one device."""
    from mstar_core.integrations.transformers.local import read_model, resolve

    dtype = torch.float32 if a.smoke else torch.bfloat16
    src = resolve(path)
    from mstar_core.integrations.transformers.local import read_config

    model, _ = read_model(src, read_config(src), a.device, dtype, a.seed)
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=a.device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new, min_new_tokens=a.new,
                               do_sample=False, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    del model
    return {"ids": out, "dtype": str(dtype).replace("torch.", "")}


def agreement(got: list[list[int]] | None, want: list[list[int]]) -> dict:
    if not got:
        return {"identical": None, "mean_common_prefix": None}
    common = []
    for x, y in zip(got, want, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        common.append(n)
    return {"identical": sum(x == y for x, y in zip(got, want, strict=True)), "of": len(want),
            "mean_common_prefix": sum(common) / len(common)}


def run_model(name: str, a, work: Path) -> dict:
    path, prompts, how = prepare(name, a, work)
    pf = work / f"{name}.jsonl"
    pf.write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    q, kv = heads(path)
    n = ranks_for(path, a.gpus)
    res: dict = {"path": path, "heads": [q, kv], "sharded_by": how, "prompts": len(prompts),
                 "prompt_tokens": sum(map(len, prompts)), "tp": n}
    if n is None:  # what a user gets asking for two ranks
        res["refused"] = generate(path, str(pf), 2, "bfloat16", a).get("error")
        return res
    half = "float32" if a.smoke else "bfloat16"
    runs = {f"{dt}_tp{t}": generate(path, str(pf), t, dt, a) for dt in ("float32", half) for t in (1, n)}
    res["runs"] = {k: {x: y for x, y in v.items() if x != "ids"} for k, v in runs.items()}
    ids = {k: v.get("ids") for k, v in runs.items()}
    res["float32_identical"] = ids["float32_tp1"] is not None and ids["float32_tp1"] == ids[f"float32_tp{n}"]
    hf = hf_greedy(path, prompts, a)
    res["against_transformers"] = {f"{half}_tp{t}": agreement(ids[f"{half}_tp{t}"], hf["ids"]) for t in (1, n)}
    res["transformers_dtype"] = hf["dtype"]
    return res


def page(doc: dict) -> list[str]:
    lines = ["# Tensor-parallel generation: `mstar generate --tp N` against `--tp 1` and transformers", "",
             report.environment_line(doc["env"]), "",
             f"{doc['new']} greedy tokens a prompt, no early stop; decode step: the median interval between "
             "steady decode steps (graphs on CUDA); float32 on the reference backend, bf16 on auto.", ""]
    rows = []
    for name, r in doc["models"].items():
        for k, v in r.get("runs", {}).items():
            rows.append((name, k, v.get("backend"), v.get("sharded_by"), v.get("graph_steps"),
                         v.get("decode_step_ms_median"), v.get("tokens_per_s"), v.get("load_seconds"), v.get("error")))
    lines += report.table(("model", "run", "backend", "sharded by", "graph steps", "decode step ms", "tokens/s",
                           "load s", "error"), rows, spec=".4g")
    lines += ["", "Against transformers' own greedy `generate` (one device):", ""]
    agree = [(name, k, v["identical"], v.get("of"), v["mean_common_prefix"])
             for name, r in doc["models"].items() for k, v in r.get("against_transformers", {}).items()]
    lines += report.table(("model", "run", "identical prompts", "of", "mean common prefix"), agree, spec=".4g")
    refused = [(name, r["heads"], r["refused"]) for name, r in doc["models"].items() if "refused" in r]
    if refused:
        lines += ["", "Not sharded (no rank count up to the GPUs divides the heads):", "",
                  *report.table(("model", "query / KV heads", "what --tp 2 says"), refused)]
    return [*lines, "", *report.targets_table(doc["targets"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default $OUT; none: print)")
    ap.add_argument("--models", default="smollm2,llama1b,llama1b_seed")
    ap.add_argument("--smol", default=None, help=f"folder holding {GGUF} (none: smollm2 is skipped)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpus", type=int, default=None, help="ranks available (default: the GPUs this host shows)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    ap.add_argument("--work", default=None, help="where the models and prompt files are written (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU over gloo ranks (the script only)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.device, a.prompts, a.prompt_len, a.new = "cpu", 3, 12, 6
    a.gpus = a.gpus or torch.cuda.device_count()
    work = Path(a.work or tempfile.mkdtemp(prefix="tp_generate-"))
    work.mkdir(parents=True, exist_ok=True)
    models = {}
    for name in a.models.split(","):
        if name == "smollm2" and not a.smol and not a.smoke:
            models[name] = {"error": "not run: no --smol folder"}
            continue
        t0 = time.perf_counter()
        models[name] = report_errors(lambda n=name: run_model(n, a, work))
        models[name]["script_s"] = time.perf_counter() - t0
        print(json.dumps({name: models[name]}, default=str)[:2000], flush=True)
    targets = {}
    for name, r in models.items():
        if "float32_identical" in r:
            targets[f"{name}: float32 greedy ids at --tp {r['tp']} identical to --tp 1"] = report.target(
                r["float32_identical"], "identical", bool(r["float32_identical"]))
    env = report.environment()
    env.update(gpus=torch.cuda.device_count(),
               nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None)
    doc = {"env": env, "new": a.new, "models": models, "targets": targets}
    if a.out:
        report.write(a.out, "tp_generate", doc, page(doc))
    else:
        print("\n".join(page(doc)))
    return 0


def report_errors(fn) -> dict:
    """``fn()``, or the error it raised (one model's failure does not end the others)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded in the results
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    raise SystemExit(main())
