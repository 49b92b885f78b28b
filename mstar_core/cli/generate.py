"""``mstar generate``: a local transformers model (a directory or a GGUF file) generating through
mstar. Everything that can be checked without the weights (flags, prompt files, token ids against
the vocabulary, lengths against the model's positions) is checked before they load."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from typing import Any

from mstar_core.cli.demo import check_seed
from mstar_core.cli.generate_inputs import check_fits, check_flags, encode_all, sampling_from
from mstar_core.cli.options import (
    add_compile,
    add_config,
    add_threads,
    apply_threads,
    check_backend,
    check_device,
    check_dtype,
    check_threads,
    config_from,
)
from mstar_core.cli.parallel import add_tp, launched
from mstar_core.cli.prompt_input import Prompt, gather
from mstar_core.distributed import check_shardable
from mstar_core.errors import StateError

PROGRESS_EVERY_S = 5.0  # a progress line on stderr for runs longer than this


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generation of a local transformers model (directory or GGUF file) through mstar",
        description="Load a causal LM from a local directory (config.json; safetensors weights when present, "
        "else random weights from --seed) or a .gguf file (nothing is downloaded), switch its attention to mstar "
        "and generate with continuous batching (greedy unless sampling flags are given). Prints the load time, "
        "the backend, steps by kind, tokens/s and each prompt's generated ids and text. Needs the transformers "
        "extra: pip install '.[transformers]' in a clone of mstar.",
    )
    p.add_argument("model", help="a local model directory (config.json, optional *.safetensors and tokenizer), a "
                   ".gguf file, or a directory holding one .gguf file")
    src = p.add_argument_group("prompts (text unless --ids)")
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="a prompt; repeat for several requests (token ids with --ids)")
    src.add_argument("--prompt-file", action="append", metavar="PATH",
                     help="prompts from a file: one a line (blank lines skipped; token ids with --ids), or a .jsonl "
                     "file whose lines are {\"prompt\": TEXT}, {\"messages\": [{\"role\": ..., \"content\": ...}]} "
                     "(always through the chat template) or {\"ids\": [1, 2]}; repeatable, read after --prompt")
    src.add_argument("--ids", action="store_true",
                     help="--prompt values and prompt-file lines are token ids (\"1,2,3\" or \"1 2 3\"), not text")
    src.add_argument("--chat", action="store_true",
                     help="put each text prompt through the tokenizer's chat template as a user message, with the "
                     "assistant's turn opened")
    src.add_argument("--system", metavar="TEXT",
                     help="with --chat: a system message before each chat (a \"messages\" line that starts with its "
                     "own system message keeps it)")
    out = p.add_argument_group("generation")
    out.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="new tokens per prompt (default 32)")
    out.add_argument("--stop", action="append", metavar="STRING",
                     help="end a request at the token that completes STRING; its text is cut before STRING "
                     "(repeatable)")
    out.add_argument("--ignore-eos", action="store_true", help="never stop at the end-of-sequence token")
    out.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default 0: greedy)")
    out.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest tokens (default 0: all)")
    out.add_argument("--top-p", type=float, metavar="P",
                     help="sample from the likeliest tokens holding P of the mass (default 1)")
    out.add_argument("--min-p", type=float, metavar="P",
                     help="drop tokens less likely than P times the likeliest (default 0: none)")
    out.add_argument("--repetition-penalty", type=float, metavar="R",
                     help="> 1 discourages tokens already in the prompt or output (default 1: none)")
    out.add_argument("--sampling-seed", type=int, metavar="S",
                     help="prompt i draws with seed S+i, the same tokens alone or in any batch (default: seeds from "
                     "torch's default generator)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--backend", default=None,
                     help="backend name or 'auto' (default auto; $MSTAR_ATTENTION_BACKEND, when set, overrides it)")
    eng.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    eng.add_argument("--dtype", default="auto",
                     help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    eng.add_argument("--seed", type=int, default=0,
                     help="random weights' seed when the directory has none (default 0)")
    eng.add_argument("--batch-size", type=int, metavar="N",
                     help="requests in one step at most (default: every prompt, at most 64)")
    eng.add_argument("--page-size", type=int, metavar="N", help="tokens per KV page (default 16)")
    eng.add_argument("--max-pages", type=int, metavar="N",
                     help="KV pages in the cache (default: room for every prompt at once)")
    eng.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                     help="replay decode steps from CUDA graphs (default: on for CUDA); on a CPU the graph path "
                     "runs without CUDA graphs, each replay re-running the forward")
    eng.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                     help="prompts that share a prefix share its KV pages, computed once (default: the config's "
                     "[kv] prefix_cache, else off); the report gives the tokens found")
    add_compile(eng, "the model's decode steps (the graph steps; on a CPU the graph path runs without CUDA graphs)")
    add_tp(eng, "generate DIR")
    add_threads(eng)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_config(p)
    p.set_defaults(func=run)


class _Progress:
    """``on_step``: a line on stderr every few seconds once a run is long, and where one was
    printed a last one with the tokens generated (requests that end early leave the total, every
    prompt's ``--max-new-tokens``, an upper bound)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.done = 0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        self.done = done
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.shown = True
            print(f"mstar generate: {done} tokens of at most {total}, {now - self.t0:.0f} s", file=sys.stderr,
                  flush=True)

    def end(self) -> None:
        if self.shown:
            print(f"mstar generate: done, {_tokens(self.done)} generated in {time.perf_counter() - self.t0:.0f} s",
                  file=sys.stderr, flush=True)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _options(args: argparse.Namespace, config: Any, count: int, tokenizer: Any, printing: bool) -> dict[str, Any]:
    """``generate_report``'s options for these flags; only what a flag asks for is passed.
    ``printing``: this process reports progress (rank 0 of a tensor-parallel run)."""
    from mstar_core.integrations.transformers.text import StopStrings

    options: dict[str, Any] = {"config": config, "tp_timeout_s": args.tp_timeout}
    if printing:
        options["on_step"] = _Progress()
    for flag, name in (("batch_size", "max_batch_size"), ("page_size", "page_size"), ("max_pages", "max_pages")):
        if getattr(args, flag) is not None:
            options[name] = getattr(args, flag)
    if args.graphs is not None:
        options["graphs"] = args.graphs
    if args.prefix_cache is not None:
        options["prefix_cache"] = args.prefix_cache
    if args.compile:
        options.update(compile=True, compile_backend=args.compile_backend)
    if args.ignore_eos:
        options["eos_token_id"] = None
    sampling = sampling_from(args, count)
    if sampling is not None:
        options["sampling"] = sampling
    if args.stop:
        options["stop"] = StopStrings(tokenizer, args.stop)
    return options


def _eos(model: Any, ignore: bool) -> set[int]:
    eos = None if ignore else getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _results(prompts: list[Prompt], ids: list[list[int]], rep: Any, tokenizer: Any, stop: Any, eos: set[int],
             max_new: int) -> list[dict[str, Any]]:
    from mstar_core.integrations.transformers.text import decode

    out = []
    cached = rep.cached_tokens or (None,) * len(ids)
    for p, prompt_ids, new, ttft, hit in zip(prompts, ids, rep.ids, rep.first_token_s, cached, strict=True):
        text, stopped = (decode(tokenizer, new), False) if tokenizer is not None else (None, False)
        if stop is not None and text is not None:
            text, stopped = stop.cut(text)
        # short of max_new without an end-of-sequence token: the stop check ended it
        finish = "eos" if not stopped and new and new[-1] in eos else \
            "length" if not stopped and len(new) >= max_new else "stop"
        row: dict[str, Any] = {"source": p.where, "text": p.text, "ids": prompt_ids, "generated_ids": new,
                               "generated_text": text, "finish": finish, "first_token_s": ttft,
                               "cached_tokens": hit}
        if p.messages is not None:
            row["messages"] = p.messages
        out.append(row)
    return out


def _chat_hint(prompts: list[Prompt], rows: list[dict[str, Any]], tokenizer: Any, chat: bool) -> str | None:
    """One line suggesting ``--chat`` where text prompts given without it ended at their first
    token (end-of-sequence) and the tokenizer has a chat template: an instruct model's usual
    answer to text outside its template."""
    from mstar_core.integrations.transformers.text import has_chat_template

    if chat or tokenizer is None or not has_chat_template(tokenizer):
        return None
    ended = [i for i, (p, r) in enumerate(zip(prompts, rows, strict=True))
             if p.text is not None and p.messages is None and r["finish"] == "eos" and len(r["generated_ids"]) == 1]
    if not ended:
        return None
    which = ", ".join(f"[{i}]" for i in ended[:5]) + (f" and {len(ended) - 5} more" if len(ended) > 5 else "")
    return (f"mstar generate: hint: {which} ended at once (the first new token was end-of-sequence); the tokenizer "
            "has a chat template, and an instruct model expects its prompts put through it: try --chat")


def run(args: argparse.Namespace) -> int:
    check_threads(args, "generate")
    check_seed(args.seed, "generate")
    device = check_device(args.device, "generate")
    config = config_from(args)  # before the model loads: a typo fails fast
    dtype = check_dtype(args.dtype, device, "generate")
    check_flags(args)
    prompts = gather(args.prompt, args.prompt_file, args.ids)
    check_backend(args.backend, config, device)  # a misspelt name fails now, not after the load
    threads = apply_threads(args, "generate", quiet=args.json)
    if importlib.util.find_spec("transformers") is None:
        raise StateError("mstar generate needs transformers: pip install '.[transformers]' in a clone of mstar")
    from mstar_core.integrations.transformers import generate_report
    from mstar_core.integrations.transformers.local import read_config, read_model, read_tokenizer, resolve
    from mstar_core.integrations.transformers.parallel import head_counts, model_sharding

    t0 = time.perf_counter()
    source = resolve(args.model)
    model_config = read_config(source)
    if args.tp > 1:  # before any process group or weights: a rank count that cannot split the heads
        check_shardable(args.tp, *head_counts(model_config), who=f"generate --tp {args.tp}")
    tokenizer = read_tokenizer(source)
    ids = encode_all(prompts, tokenizer, source, chat=args.chat, system=args.system)
    check_fits(prompts, ids, model_config, args.max_new_tokens)
    with launched(args.tp, str(device), "generate DIR", args.tp_timeout) as (tp, dev):
        model, weights = read_model(source, model_config, str(dev), dtype, args.seed, args.tp)
        load_s = time.perf_counter() - t0
        printing = tp is None or tp.rank == 0
        options = _options(args, config, len(prompts), tokenizer, printing)  # the progress line counts from here
        rep = generate_report(model, ids, args.max_new_tokens, args.backend, tp, **options)
        sharded = model_sharding(model)
    if not printing:
        return 0  # rank 0 prints; every rank generated the same ids (checked)
    options["on_step"].end()
    rows = _results(prompts, ids, rep, tokenizer, options.get("stop"), _eos(model, args.ignore_eos),
                    args.max_new_tokens)
    hint = _chat_hint(prompts, rows, tokenizer, args.chat)
    ttft = sorted(rep.first_token_s)
    dec = sorted(rep.decode_step_ms())
    dtype_name = str(dtype).replace("torch.", "")
    if args.json:
        out = {
            "model": args.model, "architecture": type(model).__name__, "weights": "loaded" if weights else "random",
            "backend": rep.backend, "device": str(device), "dtype": dtype_name, "load_seconds": load_s,
            "steps": rep.kinds, "waits": rep.waits, "new_tokens": rep.new_tokens, "seconds": rep.seconds,
            "tokens_per_s": rep.tokens_per_s, "first_token_s_median": ttft[len(ttft) // 2],
            "decode_step_ms_median": dec[len(dec) // 2] if dec else None,
            "graph_steps": sum(1 for x in rep.steps if x.graph),
            "compiled": rep.compiled, "prefix_hit_rate": rep.prefix_hit_rate, "prefill_tokens": rep.prefill_tokens,
            "ids": rep.ids, "prompts": rows, "tp": args.tp, "threads": threads.count, "threads_why": threads.why,
            "sharded_by": None if sharded is None else sharded.by,
        }
        if tokenizer is not None:
            out["texts"] = [r["generated_text"] for r in rows]
        print(json.dumps(out, indent=2))
        _say(hint)
        return 0
    what = ("GGUF weights" if source.gguf else "weights") if weights else f"random weights, seed {args.seed}"
    print(f"model: {type(model).__name__} from {args.model} ({what}, {dtype_name} on {device}), "
          f"loaded in {load_s:.2f} s")
    if sharded is not None:
        how = "loaded sharded" if sharded.by == "transformers" else "each rank loaded the whole model, kept its slice"
        print(f"tensor parallel: {sharded.tp.world_size} ranks, the heads sharded by {sharded.by} ({how})")
    for line in rep.lines():
        print(line)
    for i, r in enumerate(rows):
        # the finish ends each prompt's last line: its text, or its ids where there is no text
        finish = f"(finish: {r['finish']}, {_tokens(len(r['generated_ids']))})"
        text = r["generated_text"]
        print(f"[{i}] {' '.join(map(str, r['generated_ids']))}" + ("" if text is not None else f" {finish}"))
        if text is not None:
            print(f"[{i}] {text!r} {finish}")
    _say(hint)
    return 0


def _say(hint: str | None) -> None:
    """The hint on stderr, after the report (stdout stays the report alone: --json parses)."""
    if hint is not None:
        sys.stdout.flush()
        print(hint, file=sys.stderr, flush=True)
