"""What every benchmark times with: CUDA-event medians, host-time medians with the GPU idle,
raw-vs-mstar pairs timed in alternating rounds, wall-clock medians of whole steps, and the
device-to-device copy ceiling. Every function takes a ``device``; off CUDA the host clock stands
in for the events, so a benchmark's CPU smoke run takes the same code path."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

Fn = Callable[[], object]
CUDA = torch.device("cuda")


class Event(Protocol):
    """What a timing event offers: ``torch.cuda.Event`` or :class:`HostEvent`."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class HostEvent:
    """``torch.cuda.Event``'s timing surface on the host clock (a CPU smoke run)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: HostEvent) -> float:
        return (end_event.t - self.t) * 1e3


def event(device: torch.device = CUDA) -> Event:
    """A timing event on ``device``: a CUDA event, or the host clock off CUDA."""
    return torch.cuda.Event(enable_timing=True) if torch.device(device).type == "cuda" else HostEvent()


def sync(device: torch.device = CUDA) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def back_to_back_ms(fn: Fn, reps: int, device: torch.device = CUDA) -> float:
    """Mean time of ``reps`` calls queued back to back, bracketed by one pair of events."""
    a, b = event(device), event(device)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def kernel_ms(fn: Fn, reps: int = 20, rounds: int = 7, warm: int = 3, device: torch.device = CUDA) -> float:
    """Median over ``rounds`` of the mean time of ``reps`` back-to-back calls: for kernels short
    enough that one call's launch gap would dominate a single-call timing."""
    for _ in range(warm):
        fn()
    sync(device)
    return statistics.median(back_to_back_ms(fn, reps, device) for _ in range(rounds))


def events_ms(fn: Fn, reps: int = 20, warm: int = 3, device: torch.device = CUDA) -> float:
    """Median of ``reps`` single calls, each timed by its own events (after ``warm`` untimed)."""
    return kernel_ms(fn, reps=1, rounds=reps, warm=warm, device=device)


def queued_events_ms(fn: Fn, reps: int, inner: int, device: torch.device = CUDA) -> float:
    """Median of ``reps x inner`` calls, each bracketed by events, with no sync between the
    ``inner`` calls of one rep: the host runs ahead as it would in a forward."""
    times: list[float] = []
    for _ in range(reps):
        ev = [(event(device), event(device)) for _ in range(inner)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        sync(device)
        times.extend(s.elapsed_time(e) for s, e in ev)
    return statistics.median(times)


def paired_ms(raw_fn: Fn, w_fn: Fn, reps: int = 10, rounds: int = 15,
              device: torch.device = CUDA) -> tuple[float, float]:
    """Raw and wrapper timed in alternating rounds of ``reps`` back-to-back calls (clock and
    cache drift hit both alike); the median of each."""
    for _ in range(3):
        raw_fn()
        w_fn()
    sync(device)
    t: dict[int, list[float]] = {0: [], 1: []}
    for i in range(2 * rounds):
        t[i % 2].append(back_to_back_ms((raw_fn, w_fn)[i % 2], reps, device))
    return statistics.median(t[0]), statistics.median(t[1])


def paired_host_us(fns: list[Fn], reps: int = 61, after: Fn | None = None,
                   device: torch.device = CUDA) -> list[float]:
    """Host time of each of ``fns`` in alternating calls, the GPU idle before each; medians in
    microseconds. Host timings drift run to run by more than the overheads measured here, so the
    contenders are interleaved. ``after`` (untimed) runs after each call (e.g. to undo it)."""
    for fn in fns:
        fn()
        if after is not None:
            after()
    t: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            sync(device)
            t0 = time.perf_counter()
            fn()
            t[i].append((time.perf_counter() - t0) * 1e6)
            if after is not None:
                after()
    sync(device)
    return [statistics.median(x) for x in t]


def host_us(fn: Fn, reps: int = 25, device: torch.device = CUDA) -> float:
    """Median host time of ``fn`` (microseconds) with the GPU idle before each call."""
    return paired_host_us([fn], reps, device=device)[0]


def wall_ms(fn: Fn, reps: int, device: torch.device = CUDA) -> float:
    """Median wall time of ``fn`` synchronised at both ends (ms): host work and GPU work both
    count, as for a whole step."""
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(gib: int = 4) -> dict:
    """Device-to-device copy of ``gib`` GiB: bytes read + written per second, the memory ceiling
    a bandwidth-bound kernel is held against."""
    n = gib << 30
    ms = _copy_ms(n)
    torch.cuda.empty_cache()  # the two buffers are gone with _copy_ms
    return {"bytes": n, "ms": ms, "tb_per_s": 2 * n / (ms * 1e-3) / 1e12}


def _copy_ms(n: int) -> float:
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return kernel_ms(lambda: dst.copy_(src), reps=5, rounds=5)
