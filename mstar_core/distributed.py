"""Tensor parallelism on an existing ``torch.distributed`` process group.

Attention is sharded by heads: each rank holds ``num_kv_heads / world`` KV heads and the query
heads that read them, so a rank's attention and KV cache are those of a smaller model and every
backend runs unchanged. Every rank runs the same scheduler over the same requests, so admission
decisions agree by construction; after warm-up a KV manager given the group checks that they do
(:meth:`TensorParallel.check_same`) and fails loudly on every rank when not.

A rank that fails mid-run must not leave the others waiting forever: every collective here
gives up after the process group's timeout with a :class:`TensorParallelError` that says so
where the backend reports it (gloo), and :func:`stall_guard` covers what no collective timeout
ends: PyTorch's NCCL watchdog does not track collectives replayed from a CUDA graph, and for
eager ones it logs the timeout and only tears the process down later.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self, TypeVar

import torch
import torch.distributed as dist

from mstar_core.errors import InputError, StateError, TensorParallelError

T = TypeVar("T")

# How long a collective waits for the other ranks before it fails (and, plus STALL_GRACE_S, how
# long the stall watchdog waits for a step). Long enough for a kernel library compiling on first
# use on one rank while the other waits (FlashInfer: 20-120 s), short enough that a dead peer is
# noticed.
DEFAULT_TIMEOUT_S = 300.0
# The stall watchdog fires this much later than a collective's own timeout: where a collective's
# failure is reported (gloo), its error names the collective and comes first.
STALL_GRACE_S = 10.0


def check_shardable(world_size: int, num_qo_heads: int, num_kv_heads: int, mlp: int | None = None,
                    who: str = "") -> None:
    """Refuse a rank count that does not divide the query heads, the KV heads (and the MLP
    width), naming the rank counts that would; ``who`` (e.g. ``"bench --tp 3"``) leads the error."""
    sizes = {"query heads": num_qo_heads, "KV heads": num_kv_heads, **({"MLP width": mlp} if mlp else {})}
    if world_size >= 1 and not any(n % world_size for n in sizes.values()):
        return
    g = math.gcd(*sizes.values())
    named = ", ".join(f"{what} {n}" for what, n in sizes.items())
    divisors = ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)
    raise InputError(f"{who + ': ' if who else ''}cannot shard {named} over {world_size} ranks: "
                     f"each must be a multiple of the rank count (rank counts that divide them all: {divisors})")


def shard_heads(num_qo_heads: int, num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """Heads one rank holds: ``(num_qo_heads / world, num_kv_heads / world)``."""
    check_shardable(world_size, num_qo_heads, num_kv_heads)
    return num_qo_heads // world_size, num_kv_heads // world_size


def peer_failed(rank: int, what: str, e: BaseException) -> TensorParallelError:
    """The error a rank raises when ``what`` failed because another rank did (``e``: what the
    process group's backend raised)."""
    first = (str(e).strip().splitlines() or ["no message"])[0]  # gloo's messages run to many lines
    return TensorParallelError(
        f"rank {rank}: {what} failed ({type(e).__name__}: {first}): another rank has failed "
        "or stalled (its own output says why); a collective gives up after the process group's timeout "
        "instead of waiting forever")


def is_collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a process group's report of a failed collective, raised by a collective a
    library ran itself (transformers' sharded layers): a ``DistError``, or the ``RuntimeError``
    gloo raises, whose message starts with its source path; not a :class:`TensorParallelError`,
    which already says so."""
    if isinstance(e, TensorParallelError):
        return False
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "/gloo/" in str(e).split("]", 1)[0])


def _collective(what: str, fn: Callable[[], T], group: dist.ProcessGroup | None) -> T:
    """Run one collective; a failure (gloo: a peer's connection closed, or the group's timeout)
    becomes a :class:`TensorParallelError` naming ``what`` and saying a peer failed."""
    try:
        return fn()
    except (RuntimeError, dist.DistError) as e:
        raise peer_failed(dist.get_rank(group), what, e) from e


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
            raise StateError("tensor parallelism needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group, or torchrun and `mstar ... --tp N`)")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def shard_heads(self, num_qo_heads: int, num_kv_heads: int) -> tuple[int, int]:
        return shard_heads(num_qo_heads, num_kv_heads, self.world_size)

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous ``1/world`` slice of ``t`` along ``dim`` (a column- or
        row-parallel weight); ``dim``'s size must divide evenly."""
        if t.shape[dim] % self.world_size:
            raise InputError(f"cannot split dimension {dim} of size {t.shape[dim]} over {self.world_size} ranks")
        # A copy, never a view: a view along dim 0 would keep the whole tensor's storage alive.
        return t.chunk(self.world_size, dim)[self.rank].clone(memory_format=torch.contiguous_format)

    @property
    def _device(self) -> torch.device:
        # NCCL reduces device tensors only; gloo host tensors.
        nccl = dist.get_backend(self.group) == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def all_reduce(self, x: torch.Tensor, what: str = "an all-reduce") -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (capturable in a CUDA graph on NCCL)."""
        _collective(what, lambda: dist.all_reduce(x, group=self.group), self.group)
        return x

    def max(self, *values: float) -> tuple[float, ...]:
        """The largest of each value over the ranks (every rank gets them), in one all-reduce."""
        t = torch.tensor(values, dtype=torch.float64, device=self._device)
        _collective("a max over the ranks", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group),
                    self.group)
        return tuple(t.tolist())

    def broadcast(self, values: Sequence[int], what: str) -> list[int]:
        """Rank 0's ``values`` on every rank (ints; e.g. seeds another rank drew differently)."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        _collective(what, lambda: dist.broadcast(t, group=self.group, group_src=0), self.group)
        return [int(x) for x in t.tolist()]

    def ranges(self, what: str, values: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """Each named int's ``(min, max)`` over the ranks, by two all-reduces of one small tensor."""
        lo = torch.tensor(list(values.values()), dtype=torch.int64, device=self._device)
        hi = lo.clone()
        for t, op in ((lo, dist.ReduceOp.MIN), (hi, dist.ReduceOp.MAX)):
            _collective(f"the check of {what}", functools.partial(dist.all_reduce, t, op=op, group=self.group),
                        self.group)
        return {name: (a, b) for name, a, b in zip(values, lo.tolist(), hi.tolist(), strict=True)}

    def check_same(self, what: str, values: Mapping[str, int], why: str = "admission decisions have diverged") -> None:
        """Raise on every rank unless the named ints are identical on all ranks (min == max);
        ``why`` ends the error."""
        bad = [f"{what} {name}: rank {self.rank} has {values[name]}, ranks range from {a} to {b}"
               for name, (a, b) in self.ranges(what, values).items() if a != b]
        if bad:
            raise StateError(f"tensor-parallel ranks disagree on {'; '.join(bad)}; {why}")


class StallWatchdog:
    """A thread that ends the process when no :meth:`pet` came for ``timeout_s`` seconds.

    A collective replayed from a CUDA graph is not tracked by PyTorch's NCCL watchdog: a rank
    whose peer died would wait in it forever. A loop that pets this once a step turns that hang
    into an error line on stderr and exit status ``exit_code`` (PyTorch's own NCCL watchdog
    likewise tears the process down after a timeout: the GPU state is unknown, nothing can be
    recovered in-process). ``on_stall`` replaces the exit (tests)."""

    def __init__(self, timeout_s: float, what: str, exit_code: int = 3,
                 on_stall: Callable[[str], None] | None = None) -> None:
        if not timeout_s > 0:
            raise InputError(f"StallWatchdog: timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.what, self.exit_code = timeout_s, what, exit_code
        self.on_stall = on_stall
        self.pets = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pet(self) -> None:
        self.pets += 1
        self._last = time.monotonic()

    def __enter__(self) -> Self:
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


@contextmanager
def stall_guard(tp: TensorParallel | None, timeout_s: float, what: str) -> Iterator[Callable[[], None]]:
    """Yields the function a loop calls once a step: under tensor parallelism a
    :class:`StallWatchdog` that fires ``STALL_GRACE_S`` after the collectives' own timeout;
    without, a no-op."""
    if tp is None:
        yield lambda: None
        return
    with StallWatchdog(timeout_s + STALL_GRACE_S, f"{what} rank {tp.rank} of {tp.world_size}") as dog:
        yield dog.pet
