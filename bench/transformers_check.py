"""transformers models through mstar on a GPU, against transformers' own eager attention in the
same dtype: teacher-forced logits (the largest error) and the share of greedy tokens that agree.

For each architecture of ``mstar_core.testing.hf_models`` at its GPU size (head dims 64, 128,
256): prompts of several lengths; transformers' eager greedy continuation of each (``new``
tokens, one prompt at a time); then through mstar (graphs on: decode steps replayed)

- teacher-forced: the prompts prefilled in one step, then the eager continuation fed one token
  per decode step; each step's logits against the eager forward of the whole sequence. For
  scale, the same eager forward in float32 against bfloat16 (what bf16 itself costs).
- greedy: ``generate`` of the prompts (continuous batching, requests arriving over steps); the
  share of positions whose token equals the eager greedy token, and where they first part.

A backend that lacks a feature the architecture needs (FlashInfer: sink logits, gpt-oss) is
replaced by ``auto``'s pick, and the line says so.

    python3 bench/transformers_check.py --out $OUT   # writes transformers_check.json and .md
    python3 bench/transformers_check.py --size tiny --device cpu --backend reference   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import time

import report
import torch

from mstar_core import BackendUnavailable, Engine, EngineOptions, KVSpan, KVStep, Step, generate_report
from mstar_core.integrations.transformers.engine import LABEL
from mstar_core.testing.hf_models import ARCHITECTURES, build

LENGTHS = (1, 15, 16, 17, 64, 100, 257, 33)
ARRIVALS = (0, 0, 0, 1, 2, 3, 5, 8)


def eager_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new)
    return out[0, len(prompt):].tolist()


def eager_logits(model, seq: list[int], start: int) -> torch.Tensor:
    """Logits of positions ``start..`` of ``seq``, one eager forward, float32 on the host."""
    with torch.no_grad():
        out = model(torch.tensor([seq], device=model.device), use_cache=False).logits[0, start:]
    return out.float().cpu()


class LogitsEngine(Engine):
    """The engine whose steps give each row's logits (teacher forcing compares them) where the
    engine's own give its next token."""

    def _next_tokens(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return logits


def teacher_forced(engine: Engine, prompts: list[list[int]], conts: list[list[int]]) -> list[torch.Tensor]:
    """mstar's logits for each prompt's last token and then each continuation token but the last,
    fed as decode steps (replayed from graphs where captured)."""
    node, runner, dev = engine.node, engine.runner, engine.device
    rids = [f"tf{i}" for i in range(len(prompts))]
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        for r in rids:
            node.ingest_request(r)
        step = Step(KVStep(tuple(KVSpan(r, LABEL, len(p)) for r, p in zip(rids, prompts, strict=False))),
                    engine.step_attn)
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        with torch.no_grad():
            logits = runner.step(step, tokens)
            for i in range(len(prompts)):
                out[i].append(logits[i].float().cpu())
            decode = Step(KVStep(tuple(KVSpan(r, LABEL, 1) for r in rids)), engine.step_attn)
            for t in range(len(conts[0]) - 1):
                tokens = torch.tensor([c[t] for c in conts], device=dev)
                logits = runner.step(decode, tokens)
                for i in range(len(prompts)):
                    out[i].append(logits[i].float().cpu())
    finally:
        for r in rids:
            node.remove_request(r)
    return [torch.stack(x) for x in out]


def check(arch: str, backend: str, device: str, new: int, seed: int, size: str = "gpu") -> dict:
    t0 = time.perf_counter()
    model = build(arch, size, torch.bfloat16, device, seed=seed)
    if hasattr(model.config, "_experts_implementation"):
        # A mixture-of-experts layer's eager loop looks up the experts hit (a host sync): the
        # batched implementation keeps the forward capturable.
        model.set_experts_implementation("batched_mm")
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    conts = [eager_greedy(model, p, new) for p in prompts]
    want = [eager_logits(model, p + c[:-1], len(p) - 1) for p, c in zip(prompts, conts, strict=False)]
    model.float()
    want32 = [eager_logits(model, p + c[:-1], len(p) - 1) for p, c in zip(prompts, conts, strict=False)]
    conts32 = [eager_greedy(model, p, new) for p in prompts]  # the yardstick: eager's own bf16 vs fp32
    model.to(torch.bfloat16)
    bf16_cost = max(float((a - b).abs().max()) for a, b in zip(want, want32, strict=False))
    scale = max(float(w.abs().max()) for w in want)
    used, why = backend, ""
    pages = sum(-(-(len(p) + new) // 16) for p in prompts) + 16
    try:
        engine = LogitsEngine(model, backend, EngineOptions(max_pages=pages, max_batch_size=len(prompts)))
    except BackendUnavailable as e:
        used, why = "auto", str(e).split(": ", 1)[-1][:160]
        engine = LogitsEngine(model, "auto", EngineOptions(max_pages=pages, max_batch_size=len(prompts)))
    with engine:
        got = teacher_forced(engine, prompts, conts)
        picked, graphs = engine.backend, engine.runner.enabled
    err = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=False))
    # Next-token agreement under teacher forcing: no divergence compounds.
    tf_same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got, want, strict=False))
    rep = generate_report(model, prompts, new, used, arrivals=list(ARRIVALS[: len(prompts)]),
                          max_batch_size=len(prompts))
    same = sum(a == b for x, y in zip(rep.ids, conts, strict=False) for a, b in zip(x, y, strict=False))
    total = sum(len(c) for c in conts)
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), len(y))
             for x, y in zip(rep.ids, conts, strict=False)]
    cfg = model.config
    return {
        "arch": arch, "backend": picked, "requested_backend": backend, "fallback_reason": why, "graphs": graphs,
        "replayed_steps": sum(1 for s in rep.steps if s.graph), "steps": rep.kinds,
        "head_dim": cfg.head_dim, "gqa": cfg.num_attention_heads // cfg.num_key_value_heads,
        "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "prompts": list(LENGTHS), "new_tokens": new,
        "tf_max_abs_err": err, "logit_scale": scale, "bf16_vs_fp32_eager_max_abs": bf16_cost,
        "greedy_same": same, "greedy_total": total, "greedy_share": same / total, "first_divergence": first,
        "tf_argmax_same": tf_same, "tf_argmax_share": tf_same / total,
        "eager_bf16_vs_fp32_greedy_share": sum(a == b for x, y in zip(conts, conts32, strict=False)
                                               for a, b in zip(x, y, strict=False)) / total,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default=",".join(ARCHITECTURES))
    p.add_argument("--backend", default="flashinfer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", default="gpu", help="gpu, or tiny (a CPU smoke run of this script)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default $OUT; none: print)")
    a = p.parse_args(argv)
    rows = []
    env = report.environment("transformers")
    print(json.dumps(env, default=str))
    for arch in a.archs.split(","):
        try:
            r = check(arch, a.backend, a.device, a.new, a.seed, a.size)
        except Exception as e:  # one architecture's failure is a result too; the others still run
            r = {"arch": arch, "error": f"{type(e).__name__}: {e}"[:400]}
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("steps", "first_divergence")}, default=str),
              flush=True)
    doc = {"env": env, "rows": rows, "targets": {
        f"{r['arch']}: greedy tokens equal to eager": report.target(r.get("greedy_share"), ">= 0.95",
                                                                   "error" not in r and r["greedy_share"] >= 0.95)
        for r in rows}}
    lines = ["# transformers models through mstar against transformers' eager attention (bf16)", "",
             report.environment_line(env), "",
             *report.table(("arch", "backend", "graphs", "replayed steps", "head dim", "gqa",
                            "teacher-forced max abs err", "logits up to", "bf16 vs fp32 eager max abs err",
                            "greedy same", "eager bf16 vs fp32 greedy", "teacher-forced next token same",
                            "first divergence", "note"),
                           ((r["arch"], *(r.get(k) for k in ("backend", "graphs", "replayed_steps", "head_dim", "gqa",
                                                             "tf_max_abs_err", "logit_scale",
                                                             "bf16_vs_fp32_eager_max_abs", "greedy_share",
                                                             "eager_bf16_vs_fp32_greedy_share", "tf_argmax_share",
                                                             "first_divergence")),
                             r.get("error") or (f"{r['requested_backend']} refused: {r['fallback_reason']}"
                                                if r.get("fallback_reason") else None)) for r in rows), spec=".4g"),
             "", *report.targets_table(doc["targets"])]
    if a.out:
        report.write(a.out, "transformers_check", doc, lines)
    else:
        print("\n".join(lines))
    return 0 if all(t["met"] for t in doc["targets"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
