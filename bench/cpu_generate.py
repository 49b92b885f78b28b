"""SmolLM2-135M-Instruct on a CPU, float32, one thread: mstar's generate (the reference backend,
graphs off: the CPU default) against transformers' sdpa ``model.generate``, in the same process.

The model is the GGUF file (``--gguf PATH``) or, by default (offline), random weights of its shape
(30 layers, hidden 576, 9 query / 3 KV heads of 64, vocabulary 49152, tied embeddings). ``--batch``
prompts (8) of ``--prompt-len`` random token ids (64; one length, so transformers' batched
``generate`` has no padding and computes exactly what mstar does), ``--new`` greedy tokens each (64).

Both generate all prompts at once: ``model.generate`` on the batch (``transformers_baselines.hf_generate``:
greedy, ``min_new_tokens`` = ``max_new_tokens``), mstar's ``generate_report`` with continuous
batching. After one untimed round of each, ``--rounds`` rounds alternate the two (a busy host's
drift hits both alike); medians. Figures: each whole call's tokens/s (prefill and, for mstar, its
engine build included), the decode step (mstar: the steady steps' median interval; transformers:
(full run - first-token run) / (new - 1)), and whether the greedy ids are identical (asserted).
Target: mstar tokens/s >= 1.0x transformers'.

    python3 bench/cpu_generate.py --out results/cpu                          # random weights
    python3 bench/cpu_generate.py --gguf DIR/SmolLM2-135M-Instruct.Q4_1.gguf --out results/cpu
    python3 bench/cpu_generate.py --smoke                                    # 2 layers: the script only
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import report
import torch
from transformers_baselines import hf_generate

from mstar_core.integrations.transformers import generate_report


def smollm2_shape(layers: int = 30):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def from_gguf(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def mstar_round(model, prompts: list[list[int]], new: int) -> dict:
    t0 = time.perf_counter()
    rep = generate_report(model, prompts, new, "reference", eos_token_id=None)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "run_s": rep.seconds, "decode_step_ms": statistics.median(rep.decode_step_ms()),
            "ttft_s": statistics.median(rep.first_token_s), "steps": rep.kinds, "ids": rep.ids}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", help="SmolLM2-135M-Instruct's GGUF file (default: random weights of its shape)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--name", default=None, help="file stem (default cpu_generate-random or cpu_generate-gguf)")
    p.add_argument("--smoke", action="store_true", help="2 layers, 2 prompts of 8, 4 tokens, 1 round")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default $OUT; none: print)")
    a = p.parse_args(argv)
    if a.smoke:
        a.gguf, a.batch, a.prompt_len, a.new, a.rounds = None, 2, 8, 4, 1
    torch.set_num_threads(1)
    model = from_gguf(a.gguf) if a.gguf else smollm2_shape(2 if a.smoke else 30)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    res: dict = {
        "env": report.environment("transformers", "gguf"), "threads": torch.get_num_threads(),
        "load_avg_start": os.getloadavg(), "model": a.gguf or "random weights, SmolLM2-135M's shape",
        "workload": {"batch": a.batch, "prompt_len": a.prompt_len, "new": a.new, "rounds": a.rounds,
                     "dtype": "float32", "layers": model.config.num_hidden_layers},
    }
    with torch.inference_mode():
        mstar_round(model, prompts, a.new)  # warm-up: first uses, allocator
        hf_generate(model, prompts, a.new, warmup=1, reps=1, first_reps=1)
        ms, hf = [], []
        for _ in range(a.rounds):
            ms.append(mstar_round(model, prompts, a.new))
            hf.append(hf_generate(model, prompts, a.new, warmup=0, reps=1, first_reps=1, return_output_ids=True))
    res["load_avg_end"] = os.getloadavg()
    same = all(m["ids"] == h["output_ids"] for m, h in zip(ms, hf, strict=True))
    res["greedy_ids_identical"] = same
    res["ids_first_row"] = ms[-1]["ids"][0]
    for r in (*ms, *hf):
        r.pop("ids", None)
        r.pop("output_ids", None)
    res["mstar_rounds"], res["generate_rounds"] = ms, hf
    res["figures"] = f = figures(ms, hf, a.batch * a.new)
    ratio = f["tok_per_s_ratio"]
    res["targets"] = {
        "mstar tokens/s / transformers generate (sdpa)": report.target(ratio, ">= 1.0", ratio >= 1.0),
        "greedy ids identical": report.target(same, "identical", same),
    }
    ttft = f["mstar_ttft_ms"] / f["generate_ttft_ms"]
    lines = [f"# SmolLM2-135M-Instruct on a CPU ({res['model']}): mstar reference against transformers' generate",
             "", report.environment_line(res["env"]),
             f"{res['threads']} thread; load average {res['load_avg_start'][0]:.2f} at the start, "
             f"{res['load_avg_end'][0]:.2f} at the end.", "",
             f"{a.batch} prompts of {a.prompt_len} tokens, {a.new} new tokens each, float32, both batched; medians of "
             f"{a.rounds} alternating rounds after a warm-up.", "",
             *report.table(("", "mstar (reference)", "transformers generate (sdpa)", "mstar / transformers"), (
                 ("tokens/s (whole call)", f["mstar_tok_per_s"], f["generate_tok_per_s"], ratio),
                 ("whole call, s", f["mstar_wall_s"], f["generate_total_s"], f["mstar_wall_s"] / f["generate_total_s"]),
                 ("decode step, ms", f["mstar_decode_step_ms"], f["generate_decode_step_ms"], f["decode_step_ratio"]),
                 ("first token, ms", f["mstar_ttft_ms"], f["generate_ttft_ms"], ttft),
             )), "", *report.targets_table(res["targets"])]
    if a.out:
        report.write(a.out, a.name or ("cpu_generate-gguf" if a.gguf else "cpu_generate-random"), res, lines)
    else:
        print("\n".join(lines))
    assert same, "mstar's greedy ids differ from transformers' generate"
    return 0


def figures(ms: list[dict], hf: list[dict], tokens: int) -> dict:
    med = statistics.median
    f = {
        "mstar_wall_s": med(m["wall_s"] for m in ms), "generate_total_s": med(h["total_s"] for h in hf),
        "mstar_decode_step_ms": med(m["decode_step_ms"] for m in ms),
        "generate_decode_step_ms": med(h["decode_ms_per_step"] for h in hf),
        "mstar_ttft_ms": med(m["ttft_s"] for m in ms) * 1e3, "generate_ttft_ms": med(h["ttft_s"] for h in hf) * 1e3,
    }
    f["mstar_tok_per_s"] = tokens / f["mstar_wall_s"]
    f["generate_tok_per_s"] = tokens / f["generate_total_s"]
    f["tok_per_s_ratio"] = f["mstar_tok_per_s"] / f["generate_tok_per_s"]
    f["decode_step_ratio"] = f["mstar_decode_step_ms"] / f["generate_decode_step_ms"]
    return f


if __name__ == "__main__":
    raise SystemExit(main())
