"""``mstar demo``: run a workload end to end and check it against a no-cache reference."""

from __future__ import annotations

import argparse

from mstar_core.cli.options import add_config, add_threads, apply_threads, check_device, check_threads, config_from
from mstar_core.cli.parallel import add_tp, launched
from mstar_core.errors import InputError

WORKLOADS = ("text", "denoise", "shared-prefix")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a tiny model end to end on a backend and check its outputs",
        description="Run a tiny decoder with random weights through a backend and compare every output "
        "with a full-attention forward that uses no cache. Exits 1 on a mismatch.",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="text",
                   help="text: continuous batching (prefill, mixed, decode steps); "
                        "denoise: a frozen prefix and commit=False denoise steps on the dense path; "
                        "shared-prefix: requests that share system prompts through the paged KV manager's "
                        "prefix cache (hits, evictions), served with the cache and without")
    p.add_argument("--backend", default=None,
                   help="backend name or 'auto' (default auto; $MSTAR_ATTENTION_BACKEND, when set, overrides it)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and data seed (default: 0)")
    add_tp(p, "demo")
    add_threads(p)
    add_config(p)
    p.set_defaults(func=run)


# What torch.Generator().manual_seed takes without wrapping a negative value around: 0 .. 2**64 - 1.
SEED_MAX = 2**64 - 1


def check_seed(seed: int, command: str = "demo") -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise InputError(f"{command}: --seed {seed} is out of range; a torch seed is an integer from 0 to {SEED_MAX} "
                         "(2**64 - 1)")


def run(args: argparse.Namespace) -> int:
    check_threads(args, "demo")
    check_seed(args.seed)
    check_device(args.device, "demo")
    config = config_from(args)
    apply_threads(args, "demo")
    if args.workload != "text":
        from mstar_core.demo import denoise, shared_prefix

        if args.tp != 1:
            raise InputError(f"demo --tp: tensor parallelism runs the text workload "
                             f"(the {args.workload} workload runs on one rank)")
        workload = denoise if args.workload == "denoise" else shared_prefix
        return workload.main(backend=args.backend, device=args.device, seed=args.seed, config=config)
    from mstar_core.demo import TinyDecoderConfig, text
    from mstar_core.distributed import check_shardable

    cfg = TinyDecoderConfig()
    # before any process group: a rank count that does not shard the model fails on its own
    check_shardable(args.tp, cfg.num_qo_heads, cfg.num_kv_heads, cfg.mlp, who=f"demo --tp {args.tp}")
    with launched(args.tp, args.device, "demo", args.tp_timeout) as (tp, dev):
        return text.main(backend=args.backend, device=str(dev), seed=args.seed, config=config, tp=tp,
                         tp_timeout_s=args.tp_timeout)
