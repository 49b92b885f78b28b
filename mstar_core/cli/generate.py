"""``mstar generate``: a local transformers model's greedy generation through mstar."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from typing import Any

from mstar_core.cli.demo import check_seed
from mstar_core.cli.options import add_compile, add_config, check_device, config_from
from mstar_core.errors import InputError, StateError

PROGRESS_EVERY_S = 5.0  # a progress line on stderr for runs longer than this


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="greedy generation of a local transformers model through mstar",
        description="Load a causal LM from a local directory (config.json; safetensors weights when present, "
        "else random weights from --seed; nothing is downloaded), switch its attention to mstar and generate "
        "greedily with continuous batching. Prints the backend, steps by kind, tokens/s and the generated ids "
        "(and text, with a tokenizer). Needs the transformers extra: pip install '.[transformers]' in a clone "
        "of mstar.",
    )
    p.add_argument("model", help="local model directory (config.json, optional *.safetensors and tokenizer)")
    p.add_argument("--prompt", action="append", required=True, metavar="P",
                   help="a prompt: token ids (\"1,2,3\" or \"1 2 3\"), or text when the directory has a tokenizer; "
                   "repeat for several requests")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    p.add_argument("--backend", default=None,
                   help="backend name or 'auto' (default auto; $MSTAR_ATTENTION_BACKEND, when set, overrides it)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed when the directory has none (default 0)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps from CUDA graphs (default: on for CUDA); on a CPU the graph path "
                   "runs without CUDA graphs, each replay re-running the forward")
    add_compile(p, "the model's decode steps (the graph steps; on a CPU the graph path runs without CUDA graphs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_config(p)
    p.set_defaults(func=run)


def _prompt_ids(text: str, tokenizer: Any) -> list[int]:
    parts = text.replace(",", " ").split()
    if parts and all(x.lstrip("-").isdigit() for x in parts):
        return [int(x) for x in parts]
    if tokenizer is None:
        raise InputError(f"prompt {text!r} is not token ids (\"1,2,3\") and the model directory has no tokenizer")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class _Progress:
    """``on_step``: a line on stderr every few seconds once a run is long."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            print(f"mstar generate: {done}/{total} tokens, {now - self.t0:.0f} s", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    check_seed(args.seed, "generate")
    device = check_device(args.device, "generate")
    config = config_from(args)  # before the model loads: a typo fails fast
    if args.max_new_tokens < 1:
        raise InputError(f"generate: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if importlib.util.find_spec("transformers") is None:
        raise StateError("mstar generate needs transformers: pip install '.[transformers]' in a clone of mstar")
    from mstar_core.integrations.transformers import generate_report
    from mstar_core.integrations.transformers.local import load
    from mstar_core.resource import resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer, weights = load(args.model, str(device), dtype, args.seed)
    prompts = [_prompt_ids(p, tokenizer) for p in args.prompt]
    options: dict[str, Any] = {"on_step": _Progress(), "config": config}
    if args.graphs is not None:
        options["graphs"] = args.graphs
    if args.compile:
        options.update(compile=True, compile_backend=args.compile_backend)
    rep = generate_report(model, prompts, args.max_new_tokens, args.backend, **options)
    texts = [tokenizer.decode(ids) for ids in rep.ids] if tokenizer is not None else None
    if args.json:
        out = {
            "model": args.model, "architecture": type(model).__name__, "weights": "loaded" if weights else "random",
            "backend": rep.backend, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "steps": rep.kinds, "waits": rep.waits, "new_tokens": rep.new_tokens, "seconds": rep.seconds,
            "tokens_per_s": rep.tokens_per_s, "compiled": rep.compiled, "ids": rep.ids,
        }
        if texts is not None:
            out["texts"] = texts
        print(json.dumps(out, indent=2))
        return 0
    source = "weights" if weights else f"random weights, seed {args.seed}"
    print(f"model: {type(model).__name__} from {args.model} ({source}"
          f", {str(dtype).replace('torch.', '')} on {device})")
    for line in rep.lines():
        print(line)
    for i, ids in enumerate(rep.ids):
        print(f"[{i}] {' '.join(map(str, ids))}")
        if texts is not None:
            print(f"[{i}] {texts[i]!r}")
    return 0
