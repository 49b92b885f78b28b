"""Options several sub-commands share."""

from __future__ import annotations

import argparse
import logging
import os

import torch

from mstar_core.capabilities import PAGED
from mstar_core.compiling import BACKENDS
from mstar_core.config import Config, did_you_mean, load_config
from mstar_core.errors import InputError
from mstar_core.features import KV_DTYPES
from mstar_core.resource import DTYPE_NAMES, resolve_dtype
from mstar_core.threads import MAX_THREADS, Threads, choose, parse_count

log = logging.getLogger(__name__)


def add_config(p: argparse.ArgumentParser, pins_only: bool = False, shown: bool = False) -> None:
    """``--config FILE``: used (its backend and pins; ``pins_only``: its pins), or with ``shown``
    only judged (``mstar backends`` says what it would pick)."""
    pins = "[attention.pins] NAME = DISTRIBUTION for a name several distributions register"
    p.add_argument("--config", default=None, metavar="FILE",
                   help=f"a TOML config whose {pins} is used" if pins_only else
                   f"a TOML config: show what its [attention] backend (a name, or a table of capability -> name) "
                   f"and {pins} pick here" if shown else
                   f"a TOML config: [attention] backend = NAME, and {pins} (--backend and $MSTAR_ATTENTION_BACKEND "
                   "win over its backend)")


def add_compile(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help=f"compile {what} with torch.compile, once per graph bucket at warm-up (default off; the "
                   "first compile in a process takes seconds to a minute, torch's caches make later ones faster)")
    p.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help=f"torch.compile backend (default inductor, which needs a C++ compiler on a CPU; "
                   f"{', '.join(BACKENDS[1:])} need none)")


def check_compile(args: argparse.Namespace, command: str) -> None:
    """With ``--compile``: ``--compile-backend`` one torch.compile has, and no ``--no-graphs``;
    refused before anything loads (the engine would refuse them only once built)."""
    if not args.compile:
        return
    known = torch._dynamo.list_backends(exclude_tags=())
    if args.compile_backend not in known:
        raise InputError(f"{command}: --compile-backend {args.compile_backend!r} is not a torch.compile backend"
                         f"{did_you_mean(args.compile_backend, known)}; mstar is tested with {', '.join(BACKENDS)} "
                         f"(this torch has {len(known)}: torch._dynamo.list_backends(exclude_tags=()))")
    if getattr(args, "graphs", None) is False:
        raise InputError(f"{command}: --compile compiles the graph steps and --no-graphs turns them off: give one "
                         "of them")


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default=None, metavar="N",
                   help="torch's intra-op threads on the CPU (default: $OMP_NUM_THREADS when set, else the cores "
                   "this process may use less those other processes keep busy now, at least 1); lower it on a "
                   "machine shared with busy processes or running several mstar processes at once")


def check_threads(args: argparse.Namespace, command: str) -> int | None:
    """``--threads`` as a count (None: not given), refused with the other flags' checks."""
    if args.threads is None:
        return None
    flag = parse_count(str(args.threads))
    if flag is None:
        raise InputError(f"{command}: --threads {args.threads!r} is not a thread count; give an integer from 1 to "
                         f"{MAX_THREADS} (or leave it out: $OMP_NUM_THREADS when set, else the free cores)")
    return flag


def apply_threads(args: argparse.Namespace, command: str, quiet: bool = False) -> Threads:
    """Choose the intra-op thread count (``--threads``, else ``OMP_NUM_THREADS``, else the free
    cores), set it in torch, log it and print it as one line unless ``quiet``. Called once the
    flags are checked and before any torch work, so that the load read is other processes' and
    the run uses the count throughout."""
    threads = choose(check_threads(args, command))
    torch.set_num_threads(threads.count)
    log.info("%s: %s", command, threads.line())
    if not quiet and os.environ.get("RANK", "0") == "0":  # one line for a tensor-parallel run, from rank 0
        print(threads.line(), flush=True)
    return threads


def config_from(args: argparse.Namespace) -> Config | None:
    """The ``--config`` file, read and checked now: a typo fails before anything is built."""
    return load_config(args.config) if args.config is not None else None


def check_backend(backend: str | None, config: Config | None, device: torch.device) -> None:
    """The backend ``--backend``, ``$MSTAR_ATTENTION_BACKEND`` or the config names (or auto),
    selected for the paged steps on ``device`` before anything loads: an unknown name (with a
    did-you-mean and the known backends), or one that cannot run there, is the error the
    engine's own selection would give later. The model's dtype, head dim and features are
    judged when the engine is built."""
    from mstar_core.registry import select_backend  # plugins load here

    select_backend(capabilities=PAGED, requested=backend, device=device, dtype=None, head_dim=None, config=config)


def check_dtype(text: str, device: torch.device, command: str) -> torch.dtype:
    """``--dtype TEXT`` (auto: bfloat16 on CUDA, float32 elsewhere), refused naming the option."""
    try:
        return resolve_dtype(text, device)
    except InputError:
        names = ("auto", *DTYPE_NAMES)
        raise InputError(f"{command}: --dtype {text!r} is not supported{did_you_mean(text, names)}; choose one of "
                         f"{', '.join(names)}") from None


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
