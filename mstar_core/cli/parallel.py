"""How ``mstar demo/bench --tp N`` joins a tensor-parallel group: one process a rank, started by
torchrun, whose environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) says where it sits."""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from mstar_core.distributed import DEFAULT_TIMEOUT_S, STALL_GRACE_S, TensorParallel
from mstar_core.errors import InputError

log = logging.getLogger(__name__)


def _rank_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a rank count >= 1, got {text!r}")
    return n


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return s


def add_tp(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--tp", type=_rank_count, default=1, metavar="N",
                   help=f"tensor parallelism over N ranks, the heads sharded (default 1); run as N processes: "
                   f"torchrun --nproc-per-node N -m mstar_core.cli {command} --tp N ... (NCCL with one GPU a rank "
                   "on --device cuda, gloo on cpu)")
    p.add_argument("--tp-timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="how long a rank waits for the others in a collective before it fails with an error instead "
                   f"of hanging; a rank that makes no progress for {STALL_GRACE_S:g} s more ends itself "
                   f"(default {DEFAULT_TIMEOUT_S:g})")


@contextmanager
def launched(size: int, device: str, command: str, timeout_s: float = DEFAULT_TIMEOUT_S
             ) -> Iterator[tuple[TensorParallel | None, torch.device]]:
    """This rank of a run over ``size`` ranks launched by torchrun, and its device: NCCL with one
    GPU a rank (``cuda:LOCAL_RANK``) on CUDA, gloo on a CPU. Joins the default process group (left
    again at the end) or uses one already initialised. ``size`` 1 yields ``(None, device)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        if world > 1:
            log.warning("%s --tp 1 in one of %d processes started together: every one runs the whole model and "
                        "prints; shard with --tp %d", command, world, world)
        yield None, torch.device(device)
        return
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise InputError(f"{command} --tp {size}: device {device!r}; "
                         "tensor parallelism runs on cuda (NCCL) or cpu (gloo)")
    owned = not dist.is_initialized()
    if owned and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        raise InputError(
            f"{command} --tp {size} runs as {size} processes, one a rank: launch it with torchrun, e.g. "
            f"`torchrun --nproc-per-node {size} -m mstar_core.cli {command} --tp {size} ...` "
            "(this process has no RANK/WORLD_SIZE in its environment)")
    if owned and world != size:
        raise InputError(f"{command} --tp {size}: torchrun started {world} processes; start "
                         f"--nproc-per-node {size}, one rank per shard")
    if dev.type == "cuda":
        have = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_RANK", "-1"))
        if local < 0:
            local = dist.get_rank() % max(have, 1) if not owned else 0
        if local >= have:
            raise InputError(f"{command} --tp {size}: the rank with LOCAL_RANK {local} has no GPU of its own; this "
                             f"host shows {have} (each rank needs one)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if owned:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
        log.info("tensor parallel: rank %d of %d on %s (%s, collectives time out after %g s)",
                 dist.get_rank(), size, dev, backend, timeout_s)
    else:
        log.info("tensor parallel: using the process group already initialised (its own timeout applies)")
    try:
        tp = TensorParallel.from_group()
        if tp.world_size != size:
            raise InputError(f"{command} --tp {size}: the process group has {tp.world_size} ranks")
        yield tp, dev
    except BaseException:
        # NCCL's destroy waits for the group's kernels, which a failed peer can leave spinning:
        # after an error the group is left to the process's exit. gloo's does not wait.
        if owned and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        raise
    if owned:
        dist.destroy_process_group()
