"""Tensor-parallel tests' ranks: ``run_ranks(target, ...)`` runs ``target(rank, timeout_s, ...)``
in WORLD spawned CPU processes joined by gloo through the environment torchrun gives each worker,
and returns what each rank returned or raised; ``cli_rank`` is the target that runs the CLI, and
``breaking`` makes one rank fail mid-run."""

from __future__ import annotations

import io
import os
import socket
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from typing import Any

import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, timeout_s: float, target: Callable[..., Any], args: tuple, results: Any) -> None:
    # What torchrun gives each worker: the CLI path reads exactly these.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    try:
        results[rank] = ("ok", target(rank, timeout_s, *args))
    except BaseException as e:  # noqa: BLE001 - the test reads what each rank raised
        results[rank] = ("error", f"{type(e).__name__}: {e}")


def run_ranks(target: Callable[..., Any], *args: Any, timeout_s: float = 60.0,
              join_s: float = 120.0) -> dict[int, tuple[str, Any]]:
    """``target(rank, timeout_s, *args)`` in WORLD spawned processes; {rank: ("ok", value) or
    ("error", message)}. Unlike mp.spawn, a rank that fails does not kill the others: the test
    sees what the survivors did."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        results = m.dict()
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(r, port, timeout_s, target, args, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + join_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        got = dict(results)
    assert not hung, f"ranks {hung} still running after {join_s} s: {got}"
    return got


def cli_rank(rank: int, timeout_s: float, argv: list[str]) -> tuple[int, str]:
    """One rank of ``mstar ARGV --tp-timeout timeout_s``: its exit code and what it printed."""
    from mstar_core import cli

    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main([*argv, "--tp-timeout", str(timeout_s)])
    return rc, out.getvalue()


def breaking(real: Callable[..., Any], rank: int, how: str, stall_s: float) -> Callable[..., Any]:
    """``real``, except that rank 1's fourth call raises (``how="raises"``) or first sleeps
    ``stall_s`` (otherwise: alive, not reaching the next collective in time)."""
    calls = 0

    def wrapped(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if rank == 1 and calls == 4:
            if how == "raises":
                raise ValueError("rank 1 breaks at its fourth step")
            time.sleep(stall_s)
        return real(*a, **kw)

    return wrapped
