"""A Llama-3.2-1B-shaped transformers model (hidden 2048, 16 layers, 32 query / 8 KV heads, head
dim 64, vocabulary 128256, tied embeddings; random bf16 weights) generating 128 greedy tokens for
each of 64 prompts of 512 tokens: mstar (FlashInfer, decode steps replayed from CUDA graphs, the
next step planned while one runs) against transformers' own paths measured in the same process.

mstar's figures, from one ``generate``-style run after a warm-up run:

- decode step: the median wall interval between consecutive decode steps of all 64 rows;
- GPU time: the bucket-64 graph of that step replayed back to back (``timing.kernel_ms``);
- the step's bytes: the weights read once (embedding rows aside, the tied LM head once) plus the
  K/V every row reads at the median context of those steps, over the measured copy bandwidth;
- time to first token per request (they all arrive at once; prompts join in steps of at most
  ``--max-prefill-tokens``), and tokens/s.

Targets: decode step <= 1.10x the graph's GPU time; that GPU time <= 1.5x the step's bytes over
the copy bandwidth; decode tokens/s >= 20x transformers' ``generate``.

    python3 bench/transformers_decode.py --out $OUT    # writes transformers_decode.json and .md
    python3 bench/transformers_decode.py --smoke       # a tiny CPU run of every path
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import report
import torch
from transformers_baselines import cb_workload_sizing, hf_generate, hf_generate_batch

from mstar_core import Engine, EngineOptions
from mstar_core.integrations.transformers import run
from mstar_core.testing.timing import copy_bandwidth, kernel_ms, sync


def llama_1b(vocab: int, hidden: int, layers: int, dtype: torch.dtype, device: str):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_theta=500000.0, max_position_embeddings=131072, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def step_bytes(model, rows: int, context: float) -> dict:
    """What one decode step must read: every weight once (the tied embedding counted once: the LM
    head reads all of it, the lookup a few rows) and each row's K/V at ``context`` tokens."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = rows * context * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    return {"weights": weights, "kv": int(kv), "total": int(weights + kv)}


def bench_mstar(model, prompts, new: int, backend: str, max_prefill_tokens: int) -> dict:
    batch = len(prompts)
    pages = sum(-(-(len(p) + new) // 16) for p in prompts) + batch + 1
    opts = EngineOptions(max_pages=pages, max_batch_size=batch, max_prefill_tokens=max_prefill_tokens)
    t0 = time.perf_counter()
    with Engine(model, backend, opts) as engine:
        build_s = time.perf_counter() - t0
        run(engine, prompts, 8)  # warm-up: first uses, allocator
        sync(engine.device)
        rep = run(engine, prompts, new)
        steps = rep.decode_step_ms()
        full = [s for s in rep.steps if s.kind == "decode" and s.rows == batch]
        step_ms = statistics.median(steps)
        out = {
            "backend": rep.backend, "graphs": engine.runner.enabled, "preplan": engine.runner.supports_preplan,
            "build_s": build_s, "seconds": rep.seconds, "new_tokens": rep.new_tokens, "tok_per_s": rep.tokens_per_s,
            "steps": rep.kinds, "replayed_steps": sum(1 for s in rep.steps if s.graph),
            "decode_steps_timed": len(steps),
            "decode_step_ms": step_ms, "decode_tok_per_s": batch / (step_ms / 1e3),
            "decode_step_ms_p10_p90": [statistics.quantiles(steps, n=10)[0], statistics.quantiles(steps, n=10)[-1]]
            if len(steps) >= 10 else None,
            "ttft_s_median": statistics.median(rep.first_token_s), "ttft_s_max": max(rep.first_token_s),
            "full_batch_decode_steps": len(full),
        }
        if engine.runner.enabled and engine.device.type == "cuda":
            bucket = engine.runner.bucket_for(batch)
            g = engine.runner._graphs[(bucket, 0)]  # noqa: SLF001 - the bench times the captured step itself
            out["graph_gpu_ms"] = kernel_ms(g.replay, reps=20, rounds=7)
            out["graph_bucket"] = bucket
        # Median context of the timed steps: prompts of equal length decode in lock step after
        # their prefill, so it is the prompt length plus the median new-token count of those steps.
        out["median_context"] = len(prompts[0]) + new / 2
        out["ids"] = rep.ids
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="flashinfer")
    p.add_argument("--arch", default="llama_1b",
                   help="llama_1b (the default model above), or an architecture of mstar_core.testing.hf_models at its "
                        "GPU size with --layers layers (e.g. gpt_oss: alternating windows, sink logits)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--paths", default="mstar,generate,generate_batch,generate_static",
                   help="what to run, in this order")
    p.add_argument("--smoke", action="store_true", help="a tiny CPU run of every path (checks the script only)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default $OUT; none: print)")
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.backend, a.batch, a.prompt_len, a.new, a.layers, a.hidden, a.vocab = (
            "cpu", "reference", 4, 16, 6, 2, 128, 512)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    if a.arch == "llama_1b":
        model = llama_1b(a.vocab, a.hidden, a.layers, dtype, a.device)
    else:
        from mstar_core.testing.hf_models import build

        # eager: gpt-oss has no sdpa path in transformers (its sink logits); mstar replaces attention anyway
        model = build(a.arch, "tiny" if a.smoke else "gpu", dtype, a.device, attn_implementation="eager",
                      num_hidden_layers=a.layers)
        a.vocab, a.hidden = model.config.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, a.vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    res: dict = {"env": report.environment("transformers"),
                 "workload": {k: getattr(a, k)
                              for k in ("arch", "batch", "prompt_len", "new", "layers", "hidden", "vocab")}}
    if a.device == "cuda":
        res["copy"] = copy_bandwidth()
    print(json.dumps(res), flush=True)
    for path in a.paths.split(","):
        t0 = time.perf_counter()
        try:
            if path == "mstar":
                r = bench_mstar(model, prompts, a.new, a.backend, a.max_prefill_tokens)
            elif path == "generate":
                r = hf_generate(model, prompts, a.new, reps=1, first_reps=2, return_output_ids=True)
            elif path == "generate_static":
                r = hf_generate(model, prompts, a.new, "static", reps=1, first_reps=2)
            elif path == "generate_batch":
                r = hf_generate_batch(model, prompts, a.new, reps=1, cb_overrides=cb_workload_sizing(prompts, a.new))
            else:
                raise ValueError(f"unknown path {path!r}")
        except Exception as e:  # one path's failure is a result; the others still run
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
        if r is not None:
            r["wall_s"] = time.perf_counter() - t0
        res[path] = r
        print(json.dumps({path: {k: v for k, v in (r or {}).items() if k not in ("ids", "output_ids")}}, default=str),
              flush=True)
    shaped = "A Llama-3.2-1B-shaped model" if a.arch == "llama_1b" else f"A {a.arch}-shaped model ({a.layers} layers)"
    lines = [f"# {shaped}: mstar's generate loop against transformers' own", "",
             report.environment_line(res["env"]), "", *summary(res, model, a.batch), "",
             *report.targets_table(res["targets"])]
    if a.out:
        report.write(a.out, "transformers_decode" + ("" if a.arch == "llama_1b" else f"-{a.arch}"), res, lines)
    else:
        print("\n".join(lines))
    return 0


def summary(res: dict, model, batch: int) -> list[str]:
    """The figures as markdown lines; the targets into ``res["targets"]``."""
    m = res.get("mstar") or {}
    hf = res.get("generate") or {}
    lines: list[str] = []
    t = res.setdefault("targets", {})
    if "ids" in m and "output_ids" in hf:
        same = sum(x == y for a, b in zip(m["ids"], hf["output_ids"], strict=False) for x, y in zip(a, b, strict=False))
        total = sum(len(b) for b in hf["output_ids"])
        res["greedy_same_share_vs_generate_sdpa"] = same / total
        lines.append(f"- greedy tokens equal to transformers' generate (sdpa, same weights and dtype): {same}/{total} "
                     f"= {100 * same / total:.1f}%")
    if "decode_step_ms" not in m:
        return lines
    lines.append(f"- mstar ({m['backend']}, graphs {m['graphs']}, pre-plan {m['preplan']}): decode step "
                 f"{m['decode_step_ms']:.3f} ms = {m['decode_tok_per_s']:.0f} tokens/s; TTFT median "
                 f"{m['ttft_s_median'] * 1e3:.0f} ms, max {m['ttft_s_max'] * 1e3:.0f} ms; "
                 f"{m['tok_per_s']:.0f} tokens/s with prefill")
    if "graph_gpu_ms" in m and "copy" in res:
        b = step_bytes(model, batch, m["median_context"])
        floor_ms = b["total"] / (res["copy"]["tb_per_s"] * 1e12) * 1e3
        res["floor"] = {"bytes": b, "floor_ms": floor_ms}
        step_gpu, gpu_floor = m["decode_step_ms"] / m["graph_gpu_ms"], m["graph_gpu_ms"] / floor_ms
        t["decode step / graph GPU time"] = report.target(step_gpu, "<= 1.10", step_gpu <= 1.10)
        t["graph GPU time / step bytes over copy bandwidth"] = report.target(gpu_floor, "<= 1.5", gpu_floor <= 1.5)
        lines.append(f"- graph GPU time {m['graph_gpu_ms']:.3f} ms back to back; bytes per step "
                     f"{b['total'] / 1e9:.3f} GB (weights {b['weights'] / 1e9:.3f}, KV {b['kv'] / 1e9:.3f} at context "
                     f"{m['median_context']:.0f}) / copy {res['copy']['tb_per_s']:.2f} TB/s = {floor_ms:.3f} ms")
    for path in ("generate", "generate_static", "generate_batch"):
        r = res.get(path)
        if not r or "error" in r:
            lines.append(f"- transformers {path}: {'not run' if not r else r['error']}")
            continue
        tok = r.get("decode_tok_per_s") or r.get("tok_per_s")
        what = "decode" if "decode_tok_per_s" in r else "incl. prefill"
        ratio = m["decode_tok_per_s"] / tok if tok else float("nan")
        extra = f", {r['decode_ms_per_step']:.1f} ms per decode step, TTFT {r['ttft_s'] * 1e3:.0f} ms" \
            if "decode_ms_per_step" in r else f", TTFT median {r.get('ttft_s_median', float('nan')) * 1e3:.0f} ms"
        lines.append(f"- transformers {path} ({r.get('attn_implementation')}): {tok:.0f} tokens/s {what}{extra}; "
                     f"mstar decode / this = {ratio:.1f}x")
        if path == "generate":
            t["mstar decode tokens/s / transformers generate"] = report.target(ratio, ">= 20", ratio >= 20)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
