"""The environment a measurement ran in: device, torch, CUDA, Python, the kernel libraries'
versions and the commit. Benchmarks and the GPU tests' result files record the same fields."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

# recorded by every script, installed or not (None): which kernels produced the figures
LIBRARIES = ("flashinfer-python", "tokenspeed-fa3", "triton", "mstar-core")


def dist_version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def commit() -> str:
    """``$COMMIT`` (the GPU machine's copy may have no git), else ``git rev-parse``, else unknown."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(*dists: str) -> dict:
    """Device, torch, CUDA, Python, the kernel libraries and ``dists``' versions, the commit."""
    cuda = torch.cuda.is_available()
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": "sm{}{}".format(*torch.cuda.get_device_capability()) if cuda else "-",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
    }
    env["versions"] = {d: dist_version(d) for d in (*LIBRARIES, *dists)}
    env["commit"] = commit()
    return env
