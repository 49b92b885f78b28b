"""What every GPU benchmark here times with: CUDA-event medians, host-time medians with the GPU
idle, raw-vs-mstar pairs measured alternately in one process, the device-to-device copy ceiling,
and the versions a results file records.

Scripts in bench/ import it as ``from timing import ...`` (they run as ``python3 bench/x.py``,
which puts bench/ on the path).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import torch

Fn = Callable[[], object]


class HostEvent:
    """``torch.cuda.Event``'s timing surface on the host clock (a benchmark's CPU smoke run)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


def event(device: torch.device) -> torch.cuda.Event | HostEvent:
    """A timing event on ``device``: a CUDA event, or the host clock off CUDA."""
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else HostEvent()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _round_ms(fn: Fn, reps: int) -> float:
    """Mean time of ``reps`` back-to-back calls, bracketed by one pair of CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def kernel_ms(fn: Fn, reps: int = 20, rounds: int = 7, warm: int = 3) -> float:
    """Median over ``rounds`` of the mean time of ``reps`` back-to-back calls (CUDA events):
    for kernels short enough that one call's launch gap would dominate a single-call timing."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_round_ms(fn, reps) for _ in range(rounds))


def events_ms(fn: Fn, reps: int = 20, warm: int = 3) -> float:
    """Median of ``reps`` single calls, each timed by CUDA events (after ``warm`` untimed)."""
    return kernel_ms(fn, reps=1, rounds=reps, warm=warm)


def paired_ms(raw_fn: Fn, w_fn: Fn, reps: int = 10, rounds: int = 15) -> tuple[float, float]:
    """Raw and wrapper kernels timed in alternating rounds (clock and cache drift hit both
    alike); the median of each."""
    for _ in range(3):
        raw_fn()
        w_fn()
    torch.cuda.synchronize()
    t: dict[int, list[float]] = {0: [], 1: []}
    for i in range(2 * rounds):
        t[i % 2].append(_round_ms((raw_fn, w_fn)[i % 2], reps))
    return statistics.median(t[0]), statistics.median(t[1])


def paired_host_us(fns: list[Fn], reps: int = 61, after: Fn | None = None) -> list[float]:
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
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t[i].append((time.perf_counter() - t0) * 1e6)
            if after is not None:
                after()
    torch.cuda.synchronize()
    return [statistics.median(x) for x in t]


def host_us(fn: Fn, reps: int = 25) -> float:
    """Median host time of ``fn`` (microseconds) with the GPU idle before each call."""
    return paired_host_us([fn], reps)[0]


def _copy_ms(n: int) -> float:
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return kernel_ms(lambda: dst.copy_(src), reps=5, rounds=5)


def copy_bandwidth(gib: int = 4) -> dict:
    """Device-to-device copy of ``gib`` GiB: bytes read + written per second, the memory ceiling
    a bandwidth-bound kernel is held against."""
    n = gib << 30
    ms = _copy_ms(n)
    torch.cuda.empty_cache()  # the two buffers are gone with _copy_ms
    return {"bytes": n, "ms": ms, "tb_per_s": 2 * n / (ms * 1e-3) / 1e12}


def dist_version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def versions(*dists: str) -> dict:
    """Device, torch, CUDA, Python and the named distributions' versions (None: not installed)."""
    out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    out.update({d: dist_version(d) for d in dists})
    return out
