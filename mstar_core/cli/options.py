"""Options several sub-commands share."""

from __future__ import annotations

import argparse

from ..config import Config, load_config
from ..distributed import DEFAULT_TIMEOUT_S


def add_config(p: argparse.ArgumentParser, pins_only: bool = False) -> None:
    pins = "[attention.pins] NAME = DISTRIBUTION for a name several distributions register"
    p.add_argument("--config", default=None, metavar="FILE",
                   help=f"a TOML config whose {pins} is used" if pins_only else
                   f"a TOML config: [attention] backend = NAME, and {pins} (--backend and $MSTAR_ATTENTION_BACKEND "
                   "win over its backend)")


def config_from(args: argparse.Namespace) -> Config | None:
    """The ``--config`` file, read and checked now: a typo fails before anything is built."""
    return load_config(args.config) if args.config is not None else None


def add_tp(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help=f"tensor parallelism over N ranks, the heads sharded (default 1); run as N processes: "
                   f"torchrun --nproc-per-node N -m mstar_core.cli {command} --tp N ... (NCCL with one GPU a rank "
                   "on --device cuda, gloo on cpu)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="how long a rank waits for the others in a collective (or for a step) before it fails "
                   f"with an error instead of hanging (default {DEFAULT_TIMEOUT_S:g})")
