"""Options several sub-commands share."""

from __future__ import annotations

import argparse

import torch

from mstar_core.compiling import BACKENDS
from mstar_core.config import Config, load_config
from mstar_core.errors import InputError
from mstar_core.features import KV_DTYPES


def add_config(p: argparse.ArgumentParser, pins_only: bool = False) -> None:
    pins = "[attention.pins] NAME = DISTRIBUTION for a name several distributions register"
    p.add_argument("--config", default=None, metavar="FILE",
                   help=f"a TOML config whose {pins} is used" if pins_only else
                   f"a TOML config: [attention] backend = NAME, and {pins} (--backend and $MSTAR_ATTENTION_BACKEND "
                   "win over its backend)")


def add_compile(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help=f"compile {what} with torch.compile, once per graph bucket at warm-up (default off; the "
                   "first compile in a process takes seconds to a minute, torch's caches make later ones faster)")
    p.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help=f"torch.compile backend (default inductor, which needs a C++ compiler on a CPU; "
                   f"{', '.join(BACKENDS[1:])} need none)")


def config_from(args: argparse.Namespace) -> Config | None:
    """The ``--config`` file, read and checked now: a typo fails before anything is built."""
    return load_config(args.config) if args.config is not None else None


# The device types mstar runs on (ROCm GPUs are "cuda" in torch).
DEVICE_TYPES = ("cpu", "cuda")


def parse_device(text: str, command: str, option: str = "--device") -> torch.device:
    """``--device TEXT`` as a torch device of a type mstar runs on, whether or not it is usable
    here (``mstar backends`` and ``mstar check`` judge a device this machine may lack)."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(f"{command}: {option} {text!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if dev.type not in DEVICE_TYPES:
        raise InputError(f"{command}: {option} {text!r}: mstar runs on cpu or cuda (cuda:N; ROCm GPUs are cuda too), "
                         f"not on {dev.type}")
    return dev


def check_device(text: str, command: str, option: str = "--device") -> torch.device:
    """``--device TEXT`` as a torch device this process can run on, refused where it enters:
    not a device name, a type mstar does not run on (:func:`parse_device`), CUDA in a torch
    built without it, no usable GPU, a GPU index that does not exist. Every message names the
    option, the value and what would work."""
    dev = parse_device(text, command, option)
    if dev.type != "cuda":
        return dev
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        raise InputError(f"{command}: {option} {text}: this torch ({torch.__version__}) was built without CUDA; use "
                         f"{option} cpu, or install a CUDA build of torch")
    if not torch.cuda.is_available():
        raise InputError(f"{command}: {option} {text}: no CUDA device is usable here (torch.cuda.is_available() is "
                         f"False: no GPU, or no driver); use {option} cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise InputError(f"{command}: {option} {text}: this machine shows {count} GPU(s) (cuda:0..cuda:{count - 1})")
    return dev


def parse_kv_dtype(name: str) -> str:
    """A CLI/config kv dtype name (``fp8_e4m3``, ``fp8-e4m3``, ``auto``) as :data:`KV_DTYPES` names it."""
    key = name.strip().lower().replace("-", "_")
    if key not in KV_DTYPES:
        raise InputError(f"kv dtype {name!r} is not supported; choose one of {list(KV_DTYPES)}")
    return key
