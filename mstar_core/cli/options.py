"""Options several sub-commands share."""

from __future__ import annotations

import argparse

from mstar_core.config import Config, load_config
from mstar_core.errors import InputError
from mstar_core.features import KV_DTYPES


def add_config(p: argparse.ArgumentParser, pins_only: bool = False) -> None:
    pins = "[attention.pins] NAME = DISTRIBUTION for a name several distributions register"
    p.add_argument("--config", default=None, metavar="FILE",
                   help=f"a TOML config whose {pins} is used" if pins_only else
                   f"a TOML config: [attention] backend = NAME, and {pins} (--backend and $MSTAR_ATTENTION_BACKEND "
                   "win over its backend)")


def config_from(args: argparse.Namespace) -> Config | None:
    """The ``--config`` file, read and checked now: a typo fails before anything is built."""
    return load_config(args.config) if args.config is not None else None



def parse_kv_dtype(name: str) -> str:
    """A CLI/config kv dtype name (``fp8_e4m3``, ``fp8-e4m3``, ``auto``) as :data:`KV_DTYPES` names it."""
    key = name.strip().lower().replace("-", "_")
    if key not in KV_DTYPES:
        raise InputError(f"kv dtype {name!r} is not supported; choose one of {list(KV_DTYPES)}")
    return key
