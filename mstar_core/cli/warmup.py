"""``mstar warmup``: compile (or load) every kernel a configuration will use, ahead of serving."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from mstar_core.cli.options import check_device
from mstar_core.warmup import WARMABLE, WarmupConfig, warmup

DTYPES = ("bfloat16", "float16", "float32")


def register(sub: argparse._SubParsersAction) -> None:
    d = WarmupConfig()
    p = sub.add_parser(
        "warmup",
        help="compile (or load) every kernel a configuration uses, so no request waits for it",
        description="Prepare every kernel that the given configuration will use on the device: a backend that "
        "compiles on first use (FlashInfer: 20-120 s per kernel family on an H200, cached in ~/.cache/flashinfer "
        "afterwards) does it now, through a tiny plan and run of each variant. Run it at build time, on the "
        "machine (or image) that serves. Prints what was compiled or loaded and how long each took. The backends "
        "are selected for the windows and soft-cap given, as `mstar backends --layer-windows/--soft-cap` judges "
        "them. Exits 2, warming nothing, when no backend can run any of it on the device.",
    )
    p.add_argument("--backend", default="auto",
                   help="backend name, or auto: what a build selects for the paged steps and for the dense path "
                   "(default auto; $MSTAR_ATTENTION_BACKEND, when set, overrides it)")
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="q/KV dtype (default bfloat16)")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help=f"head dimension (default {d.head_dim})")
    p.add_argument("--page-size", type=int, default=d.page_size, help=f"KV page size (default {d.page_size})")
    p.add_argument("--qo-heads", type=int, default=d.num_qo_heads, help=f"query heads (default {d.num_qo_heads})")
    p.add_argument("--kv-heads", type=int, default=d.num_kv_heads, help=f"KV heads (default {d.num_kv_heads})")
    p.add_argument("--window", type=int, action="append", metavar="WINDOW_LEFT",
                   help="a window_left the layers use, -1 for full attention; repeat for several "
                   "(default: -1 only). Full and sliding-window attention are different kernels")
    p.add_argument("--soft-cap", type=float, default=None,
                   help="logit soft-cap of the paged path, if the model's layers use one (the paged wrappers' "
                   "logits_soft_cap); the dense path is warmed without")
    p.add_argument("--capability", action="append", choices=WARMABLE, metavar="CAP",
                   help=f"warm only these (repeatable; default all of {', '.join(WARMABLE)})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    device = check_device(args.device, "warmup")  # before any plugin loads: no GPU is one line, exit 2
    cfg = WarmupConfig(getattr(torch, args.dtype), args.head_dim, args.page_size, args.qo_heads, args.kv_heads,
                       tuple(args.window or (-1,)), args.soft_cap)
    report = warmup(cfg, args.backend, device, args.capability)
    if args.json:
        out = asdict(report)
        out["config"]["dtype"] = args.dtype
        out["seconds"] = report.seconds
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(report.lines()))
    return 0
