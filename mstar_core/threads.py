"""How many intra-op threads torch runs on a CPU: ``--threads N``, else ``OMP_NUM_THREADS``, else
the cores this process may use (its affinity set, capped by a cgroup CPU quota and by the
physical cores) less the cores other processes keep busy right now.

A thread whose core another process holds stalls every op: torch's OpenMP workers wait at each
op's barrier for the slowest of them, so on a 2-core machine with one busy process two threads
ran SmolLM2's decode step 2.5x slower than one (results/cpu/cpu_threads-gguf.md). :func:`pick`
is the rule on given readings; the ``read_*`` functions read this machine (Linux's /proc and
/sys), each ``None`` where it cannot.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SAMPLE_S = 0.1  # how long /proc/stat is watched for other processes' load
MAX_THREADS = 1024  # far above any CPU's cores; a larger value is a typo, not a choice
PROC_STAT = Path("/proc/stat")
SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class Threads:
    """The intra-op thread count chosen and why: ``source`` is ``--threads``, ``OMP_NUM_THREADS``
    or ``default``; ``why`` is the reason as the CLI prints it."""

    count: int
    source: str
    why: str

    def line(self) -> str:
        return f"threads: {self.count} ({self.why})"


def pick(cpus: int, busy: float | None = None, quota: float | None = None, physical: int | None = None) -> int:
    """The default thread count on given readings: ``cpus`` this process may run on, ``busy``
    cores other processes keep busy (None: not known), ``quota`` the cgroup CPU quota in cores,
    ``physical`` the physical cores among ``cpus``. At least 1."""
    cap = cpus
    if quota is not None:
        cap = min(cap, max(1, math.floor(quota)))  # a thread past the quota is throttled, not run
    if physical is not None:
        cap = min(cap, physical)  # a core's second hardware thread adds little to torch's dense ops
    free = cpus - math.floor(busy + 0.5) if busy is not None else cpus  # a core busy half the time is taken
    return max(1, min(cap, free))


def parse_count(text: str, nested: bool = False) -> int | None:
    """A thread count as ``--threads`` gives it, or None where it is not an integer from 1 to
    :data:`MAX_THREADS`; ``nested``: OpenMP's ``4,2`` (``OMP_NUM_THREADS``) counts as its first level."""
    head = (text.split(",")[0] if nested else text).strip()
    if not head.isdecimal():
        return None
    n = int(head)
    return n if 1 <= n <= MAX_THREADS else None


def choose(flag: int | None = None, environ: Mapping[str, str] | None = None,
           reading: tuple[int, float | None, float | None, int | None] | None = None) -> Threads:
    """The count for ``--threads`` (``flag``), else ``OMP_NUM_THREADS`` in ``environ`` (default
    ``os.environ``), else :func:`pick` on ``reading`` (``(cpus, busy, quota, physical)``; default:
    this machine's, read now)."""
    if flag is not None:
        return Threads(flag, "--threads", f"--threads {flag}")
    env = os.environ if environ is None else environ
    raw = env.get("OMP_NUM_THREADS")
    if raw is not None and raw.strip():
        n = parse_count(raw, nested=True)
        if n is not None:
            return Threads(n, "OMP_NUM_THREADS", f"OMP_NUM_THREADS={raw.strip()}; --threads N to choose")
        log.warning("OMP_NUM_THREADS=%r is not a thread count from 1 to %d: it is ignored and mstar picks the count",
                    raw, MAX_THREADS)
    cpus, busy, quota, physical = read_machine() if reading is None else reading
    n = pick(cpus, busy, quota, physical)
    parts = [f"{cpus} cores"]
    if quota is not None and quota < cpus:
        parts.append(f"a CPU quota of {quota:g}")
    if physical is not None and physical < cpus:
        parts.append(f"{physical} physical")
    load = "load of other processes not readable here" if busy is None else f"{busy:.1f} busy with other processes"
    return Threads(n, "default", f"{', '.join(parts)}, {load}; --threads N to choose")


def read_machine(sample_s: float = SAMPLE_S) -> tuple[int, float | None, float | None, int | None]:
    """This process's ``(cpus, busy, quota, physical)`` as :func:`pick` takes them."""
    cpus = affinity()
    return len(cpus), read_busy(cpus, sample_s), read_quota(), read_physical(cpus)


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cpu_times(cpus: Iterable[int]) -> dict[int, tuple[int, int]] | None:
    """Each CPU's (busy, total) jiffies from /proc/stat, or None where it cannot be read."""
    wanted = set(cpus)
    try:
        text = PROC_STAT.read_text()
    except OSError:
        return None
    out: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in wanted:
            continue
        ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out or None


def busy_between(before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]]) -> float:
    """The cores kept busy between two /proc/stat readings: each CPU's busy share, summed."""
    total = 0.0
    for cpu, (b0, t0) in before.items():
        if cpu in after and after[cpu][1] > t0:
            total += (after[cpu][0] - b0) / (after[cpu][1] - t0)
    return total


def read_busy(cpus: Iterable[int], sample_s: float = SAMPLE_S) -> float | None:
    """The cores among ``cpus`` kept busy over ``sample_s`` seconds while this process sleeps, so
    all of it is other processes' (None without /proc/stat)."""
    cpus = list(cpus)
    before = _cpu_times(cpus)
    if before is None:
        return None
    time.sleep(sample_s)
    after = _cpu_times(cpus)
    return None if after is None else busy_between(before, after)


def quota_cores(text: str) -> float | None:
    """A cgroup v2 ``cpu.max`` (``"150000 100000"``, ``"max 100000"``) in cores, None for no quota."""
    fields = text.split()
    if len(fields) < 1 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def own_cgroups(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controllers -> this process's cgroup path (``""``: cgroup v2)."""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


def _upwards(base: Path, path: str) -> list[Path]:
    """``base/path`` and each folder above it up to ``base``: a quota on any of them binds."""
    d = base / path.strip("/")
    dirs = [d]
    while base in d.parents:
        d = d.parent
        dirs.append(d)
    return dirs


def read_quota(root: Path | None = None, own: str | None = None) -> float | None:
    """The tightest CPU quota in cores on this process's cgroup and those above it (v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us``), None for none. ``own``: ``/proc/self/cgroup``'s text
    (read when None; without it, the root's quota alone)."""
    root = CGROUP if root is None else root
    paths = own_cgroups(_read(PROC_SELF_CGROUP) or "" if own is None else own)
    quotas = [quota_cores(text) for d in _upwards(root, paths.get("", "/"))
              if (text := _read(d / "cpu.max")) is not None]
    v1 = next((p for controllers, p in paths.items() if "cpu" in controllers.split(",")), "/")
    for mount in ("cpu", "cpu,cpuacct"):
        for d in _upwards(root / mount, v1):
            quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
            if quota is not None and period is not None and not quota.startswith("-"):
                quotas.append(quota_cores(f"{quota} {period}"))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def read_physical(cpus: Iterable[int], root: Path | None = None) -> int | None:
    """The physical cores among ``cpus`` (CPUs that share a core's sibling list count once), or
    None where the topology cannot be read."""
    root = SYS_CPU if root is None else root
    cores = set()
    for cpu in cpus:
        try:
            cores.add((root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            return None
    return len(cores) or None
