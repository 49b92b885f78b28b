"""How much memory a device has free, and a check that a planned allocation fits, refused
before anything is allocated: an allocation that does not fit otherwise runs until the
allocator fails (or the machine swaps), naming no option.

    from mstar_core.memory import check_fits
    check_fits(kv_bytes + weight_bytes, "cuda", "bench: the KV cache (--layers 80, --context 4096) and the weights")
"""

from __future__ import annotations

import os

import torch

from mstar_core.errors import InputError

__all__ = ["available_bytes", "check_fits", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``512.0 MiB``, ``12 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(device: torch.device | str) -> int | None:
    """Bytes an allocation on ``device`` can take now: on CUDA the device's free memory
    (``torch.cuda.mem_get_info``); on a CPU the kernel's ``MemAvailable`` (``/proc/meminfo``),
    else the physical memory (``sysconf``). None where it cannot be told (another device type, no
    usable GPU, no such interface)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        try:
            free, _total = torch.cuda.mem_get_info(dev)
        except (RuntimeError, AssertionError, ValueError):
            return None
        return int(free)
    if dev.type != "cpu":
        return None
    avail = _meminfo_available()
    if avail is not None:
        return avail
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def check_fits(nbytes: int, device: torch.device | str, what: str) -> None:
    """Raise :class:`~mstar_core.errors.InputError` when ``nbytes`` exceed what ``device`` has
    free (:func:`available_bytes`); ``what`` names what would be allocated and the options or
    arguments that size it (the message starts with it). Nothing is checked where the free memory
    cannot be told."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InputError(f"check_fits: nbytes must be an int >= 0, got {nbytes!r}")
    avail = available_bytes(device)
    if avail is None or nbytes <= avail:
        return
    raise InputError(f"{what} needs about {format_bytes(nbytes)}, more than the {format_bytes(avail)} available on "
                     f"{torch.device(device)}; make it smaller")
