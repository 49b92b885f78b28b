"""Tensor parallelism on an existing ``torch.distributed`` process group.

Attention is sharded by heads: each rank holds ``num_kv_heads / world`` KV heads and the query
heads that read them, so a rank's attention and KV cache are those of a smaller model and every
backend runs unchanged. Every rank runs the same scheduler over the same requests, so admission
decisions agree by construction; after warm-up the KV managers check that they do
(:func:`check_same_across_ranks`) and fail loudly on every rank when not.

A rank that fails mid-run must not leave the others waiting forever: every collective here gives
up after the process group's timeout with a :class:`TensorParallelError` that says so, and
:class:`StallWatchdog` covers what no collective timeout sees (collectives replayed from a CUDA
graph are not tracked by PyTorch's NCCL watchdog).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .step import is_int

log = logging.getLogger(__name__)

# How long a collective waits for the other ranks before it fails (and how long the stall
# watchdog waits for a step). Long enough for a kernel library compiling on first use on one
# rank while the other waits (FlashInfer: 20-120 s), short enough that a dead peer is noticed.
DEFAULT_TIMEOUT_S = 300.0


class TensorParallelError(RuntimeError):
    """A collective failed or timed out: another rank failed or stalled."""


def shard_heads(num_qo_heads: int, num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """Heads one rank holds: ``(num_qo_heads / world, num_kv_heads / world)``."""
    if world_size < 1 or num_kv_heads % world_size or num_qo_heads % world_size:
        raise ValueError(
            f"cannot shard {num_qo_heads} query / {num_kv_heads} KV heads over {world_size} ranks: "
            "both must be multiples of the world size"
        )
    return num_qo_heads // world_size, num_kv_heads // world_size


def tp_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL reduces device tensors only; gloo host tensors.
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def check_same_across_ranks(what: str, values: int | Mapping[str, int], group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank unless ``values`` (one int, or named ints) are identical on all ranks:
    min == max, by two all-reduces of one small tensor. A no-op without an initialised process
    group of more than one rank."""
    if not tp_active():
        return
    named = {what: values} if isinstance(values, int) else {f"{what} {k}": v for k, v in values.items()}
    lo = torch.tensor(list(named.values()), dtype=torch.int64, device=_collective_device(group))
    hi = lo.clone()
    try:
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    except (RuntimeError, dist.DistError) as e:
        raise _peer_failed(f"the check of {what}", dist.get_rank(group), e) from e
    bad = [
        f"{name}: rank {dist.get_rank(group)} has {v}, ranks range from {a} to {b}"
        for (name, v), a, b in zip(named.items(), lo.tolist(), hi.tolist()) if a != b
    ]
    if bad:
        raise RuntimeError(f"tensor-parallel ranks disagree on {'; '.join(bad)}; admission decisions have diverged")


def _peer_failed(what: str, rank: int, cause: BaseException) -> TensorParallelError:
    first = (str(cause).strip().splitlines() or ["no message"])[0]  # gloo's messages run to many lines
    return TensorParallelError(
        f"rank {rank}: {what} failed ({type(cause).__name__}: {first}): "
        "another rank has failed or stalled (its own output says why); a collective gives up after the process "
        "group's timeout instead of waiting forever"
    )


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group: ``rank`` of ``world_size``, collectives on
    ``group`` (None: the default group)."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> TensorParallel:
        """This rank in an already initialised process group (an engine's own)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("tensor parallelism needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group, or mstar's init_tensor_parallel)")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def shard_heads(self, num_qo_heads: int, num_kv_heads: int) -> tuple[int, int]:
        return shard_heads(num_qo_heads, num_kv_heads, self.world_size)

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous ``1/world`` slice of ``t`` along ``dim`` (a column- or
        row-parallel weight); ``dim``'s size must divide evenly."""
        if t.shape[dim] % self.world_size:
            raise ValueError(f"cannot split dimension {dim} of size {t.shape[dim]} over {self.world_size} ranks")
        return t.chunk(self.world_size, dim)[self.rank].contiguous()

    def all_reduce(self, x: torch.Tensor, what: str = "all-reduce") -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (capturable in a CUDA graph on NCCL)."""
        try:
            dist.all_reduce(x, group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise _peer_failed(what, self.rank, e) from e
        return x

    def max(self, value: float) -> float:
        """The largest ``value`` over the ranks (every rank gets it)."""
        dev = _collective_device(self.group)
        t = torch.tensor([value], dtype=torch.float64, device=dev)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise _peer_failed("a max over the ranks", self.rank, e) from e
        return float(t)

    def check_same(self, what: str, values: int | Mapping[str, int]) -> None:
        check_same_across_ranks(what, values, self.group)


@contextmanager
def tensor_parallel(size: int, device: str, command: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                    heads: tuple[int, int] | None = None) -> Iterator[tuple[TensorParallel | None, torch.device]]:
    """This rank of a CLI run over ``size`` ranks launched by torchrun, and its device: NCCL with
    one GPU a rank (``cuda:LOCAL_RANK``) on CUDA, gloo on a CPU. Joins the default process group
    (left again at the end) or reuses one already initialised. ``size`` 1 yields ``(None,
    device)``. ``heads`` (query, KV) are checked to shard first; ``command`` names the
    sub-command in errors."""
    if not is_int(size) or size < 1:
        raise ValueError(f"{command}: --tp must be a rank count >= 1, got {size!r}")
    if heads is not None:
        shard_heads(*heads, size)
    if size == 1:
        yield None, torch.device(device)
        return
    if timeout_s <= 0:
        raise ValueError(f"{command}: the tensor-parallel timeout must be > 0 seconds, got {timeout_s}")
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{command} --tp {size}: device {device!r}; tensor parallelism runs on cuda (NCCL) or cpu (gloo)")
    owned = not dist.is_initialized()
    if owned:
        world = os.environ.get("WORLD_SIZE")
        if world is None or "RANK" not in os.environ:
            raise ValueError(
                f"{command} --tp {size} runs as {size} processes, one a rank: launch it with torchrun, e.g. "
                f"`torchrun --nproc-per-node {size} -m mstar_core.cli {command} --tp {size} ...` "
                "(this process has no RANK/WORLD_SIZE in its environment)")
        if int(world) != size:
            raise ValueError(f"{command} --tp {size}: torchrun started {world} processes; start "
                             f"--nproc-per-node {size}, one rank per shard")
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if not owned else 0))
        have = torch.cuda.device_count()
        if local >= have:
            raise ValueError(f"{command} --tp {size}: the rank with LOCAL_RANK {local} has no GPU of its own; this "
                             f"host shows {have} (each rank needs one)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if owned:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        extra = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **extra)
        log.info("tensor parallel: rank %d of %d on %s (%s, collectives time out after %g s)",
                 dist.get_rank(), size, dev, backend, timeout_s)
    try:
        tp = TensorParallel.from_group()
        if tp.world_size != size:
            raise ValueError(f"{command} --tp {size}: the process group has {tp.world_size} ranks")
        yield tp, dev
    except BaseException:
        # NCCL's destroy waits for the group's kernels, which a failed peer can leave spinning:
        # after an error the group is left to the process's exit. gloo's does not wait.
        if owned and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        raise
    if owned:
        dist.destroy_process_group()


class StallWatchdog:
    """A thread that ends the process when no :meth:`pet` came for ``timeout_s`` seconds.

    A collective replayed from a CUDA graph is not tracked by PyTorch's NCCL watchdog: a rank
    whose peer died would wait in it forever. A loop that pets this once a step turns that hang
    into an error line on stderr and exit status ``exit_code`` (PyTorch's own NCCL watchdog
    likewise tears the process down on a timeout: the GPU state is unknown, nothing can be
    recovered in-process). ``on_stall`` replaces the exit (tests)."""

    def __init__(self, timeout_s: float, what: str, exit_code: int = 3,
                 on_stall: Callable[[str], None] | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"StallWatchdog: timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.what, self.exit_code = timeout_s, what, exit_code
        self.on_stall = on_stall
        self.pets = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pet(self) -> None:
        self.pets += 1
        self._last = time.monotonic()

    def __enter__(self) -> StallWatchdog:
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="mstar-stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle >= self.timeout_s:
                msg = (f"mstar: {self.what}: no progress for {idle:.0f} s (timeout {self.timeout_s:g} s) after "
                       f"{self.pets} steps; another tensor-parallel rank has failed or stalled (its own output "
                       "says why); ending this process instead of waiting forever")
                if self.on_stall is not None:
                    self.on_stall(msg)
                    return
                print(msg, file=sys.stderr, flush=True)
                os._exit(self.exit_code)
