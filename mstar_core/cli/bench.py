"""``mstar bench``: time the tiny decoder's decode loop on a backend."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from mstar_core.cli.options import add_compile, add_config, check_device, config_from
from mstar_core.cli.parallel import add_tp, launched
from mstar_core.demo.decode_bench import BenchOptions, run_decode_bench
from mstar_core.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    d = BenchOptions()
    p = sub.add_parser(
        "bench",
        help="time the decode loop of a tiny decoder on a backend",
        description="Time the decode loop of a tiny decoder with random weights: BATCH requests that already hold "
        "CONTEXT tokens each generate one token per step. Prints the median step time, tokens/s, host time per step "
        "and (CUDA, with graphs) the GPU time of one step's kernels replayed back to back. The backends are the paged "
        "path's (paged_prefill, paged_decode and mixed, each from its own pick), chosen as --backend says; the "
        "output's first line (--json: \"backend\") names the ones that ran. Under auto, on a CPU, that is the "
        "reference unless an installed plugin provides a paged capability and can run here (device, dtype, head dim): "
        "auto tries third-party plugins before the reference (`mstar backends` shows auto's picks). The KV cache "
        "and weights the sizes ask for are estimated first: sizes that do not fit the device's free memory are "
        "refused, naming the options. "
        "With --tp N (launched by torchrun) the model is sharded over N ranks and rank 0 prints, adding the time of "
        "the step's all-reduces alone.",
    )
    p.add_argument("--layers", type=int, default=d.layers, help=f"decoder layers (default {d.layers})")
    p.add_argument("--qo-heads", type=int, default=d.qo_heads, help=f"query heads (default {d.qo_heads})")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads,
                   help=f"KV heads, dividing --qo-heads (default {d.kv_heads})")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help=f"head dimension (default {d.head_dim})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"model width (default {d.hidden})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"requests decoding together (default {d.batch})")
    p.add_argument("--context", type=int, default=d.context,
                   help=f"tokens each request holds before the loop (default {d.context})")
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"KV page size in tokens (default {d.page_size})")
    p.add_argument("--backend", default=None,
                   help="backend name or 'auto' (default: --config's [attention] backend, else auto, which picks the "
                   "first backend in its order that runs here; $MSTAR_ATTENTION_BACKEND, when set, overrides both)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=d.graphs,
                   help="replay decode steps from CUDA graphs captured at warm-up (default off); on a CPU the graph "
                   "path runs without CUDA graphs, each replay re-running the forward")
    p.add_argument("--preplan", action=argparse.BooleanOptionalAction, default=d.preplan,
                   help="plan step N+1 while step N runs on the GPU (default off; only where every resource "
                   "supports it -- paged attention does with --graphs -- else a warning and it stays off)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"timed steps (default {d.steps})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"untimed steps first, at least 1 (default {d.warmup})")
    p.add_argument("--device", default=d.device, help="torch device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--dtype", default=d.dtype,
                   help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--query-tokens", type=int, default=d.query_tokens,
                   help="query tokens per request per step: 1, or 2..8 for multi-token decode rows (speculative "
                   "verification), captured like one-token decode (default 1)")
    add_compile(p, "the decode step's model (the graph steps; needs --graphs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_tp(p, "bench")
    add_config(p)
    p.set_defaults(func=run)


def check_options(o: BenchOptions) -> None:
    """What the tiny model itself needs beyond BenchOptions' own checks, refused before anything
    is built (the model would otherwise fail deep inside its first forward)."""
    if o.head_dim % 2:
        raise InputError(f"bench: --head-dim {o.head_dim} is odd; the tiny model's rotary embedding rotates pairs "
                         "of dimensions, so the head dim must be even (e.g. 64)")


def run(args: argparse.Namespace) -> int:
    check_device(args.device, "bench")
    fields = BenchOptions.__dataclass_fields__
    # each count >= 1, context >= 0; a bad config file fails here, before the model is built
    opts = BenchOptions(**{k: getattr(args, k) for k in fields if k != "config"}, config=config_from(args))
    check_options(opts)
    with launched(opts.tp, opts.device, "bench", opts.tp_timeout) as (tp, dev):
        res = run_decode_bench(replace(opts, device=str(dev)) if tp is not None else opts, tp=tp)
        if tp is not None and tp.rank != 0:
            return 0  # rank 0 prints the table
    if args.json:
        print(json.dumps(asdict(res), indent=2))
    else:
        for line in res.lines():
            print(line)
    return 0
