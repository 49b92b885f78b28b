"""What the registry needs to know about a device: its kind (cpu / cuda / rocm), whether it is
usable, and its architecture ("sm90", "gfx942"). Read through ``torch.cuda`` each time, so
tests can fake a GPU by monkeypatching ``torch.cuda`` and ``torch.version.hip``."""

from __future__ import annotations

import torch


def as_device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def device_kind(device: torch.device) -> str:
    """"cpu", "cuda" (NVIDIA), "rocm" (AMD: torch names it "cuda" too), or torch's type name."""
    if device.type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return device.type


def device_key(device: torch.device) -> str:
    """A cache key naming one physical device: "cuda" without an index means the current one."""
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return f"cuda:{index}"
    return str(device)


def _index(device: torch.device) -> int:
    return int(device_key(device).split(":")[1])


def device_unavailable(device: torch.device) -> str | None:
    """Why a GPU ``device`` cannot be used here (none usable, or no such index); None when it can."""
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"no GPU is usable here (torch {torch.__version__}: torch.cuda.is_available() is False)"
    count = torch.cuda.device_count()
    if _index(device) >= count:
        return f"device {device_key(device)} does not exist ({count} GPU(s) visible)"
    return None


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA device; None elsewhere or when no GPU is usable."""
    if device_kind(device) != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(_index(device))
    return int(major), int(minor)


def device_arch(device: torch.device) -> str | None:
    """"sm90" for an H100/H200, "gfx942" for an MI300; None on CPU or without a usable GPU."""
    kind = device_kind(device)
    if kind == "cuda":
        cc = compute_capability(device)
        return None if cc is None else f"sm{cc[0]}{cc[1]}"
    if kind == "rocm" and torch.cuda.is_available():
        name = getattr(torch.cuda.get_device_properties(_index(device)), "gcnArchName", "") or ""
        # gcnArchName carries feature flags after a colon: "gfx942:sramecc+:xnack-".
        return name.split(":")[0] or None
    return None


def describe(device: torch.device) -> str:
    arch = device_arch(device)
    return f"{device_key(device)} ({arch})" if arch else device_key(device)
