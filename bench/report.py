"""What every benchmark here writes: the environment it ran in (device, torch, CUDA, Python, the
kernel libraries' versions, the commit), its figures as JSON, and a markdown page of tables with
each target and whether it was met.

Scripts import it as ``import report`` (``python3 bench/x.py`` puts bench/ on the path).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
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


def environment_line(env: dict) -> str:
    libs = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v is not None)
    return (f"{env['device']} ({env['capability']}), torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}; "
            f"{libs or 'no kernel library'}; commit {env['commit']}.")


def fmt(x: Any, spec: str = ".3g", limit: int = 300) -> str:
    """One value for a table cell: yes/NO for a bool, - for None, ``spec`` for a float, text on
    one line without pipes, cut at ``limit`` characters (a compiler log would swamp the page)."""
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return format(x, spec)
    if x is None:
        return "-"
    text = " ".join(str(x).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 5] + " [..]"


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], spec: str = ".3g") -> list[str]:
    """A markdown table: a header, then one row per sequence of cells (numbers formatted by ``spec``)."""
    lines = ["| " + " | ".join(fmt(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(fmt(c, spec) for c in r) + " |" for r in rows]
    return lines


def target(value: Any, wanted: str, met: bool) -> dict:
    """One target: the figure, what it is held to, and whether it was met."""
    return {"value": value, "target": wanted, "met": bool(met)}


def targets_table(targets: dict[str, dict]) -> list[str]:
    return ["## Targets", "", *table(("what", "value", "target", "met"),
                                     ((k, t["value"], t["target"], t["met"]) for k, t in targets.items()))]


def errors_section(errors: dict[str, str]) -> list[str]:
    """What failed, each in a fenced block (a failing part leaves the others' figures)."""
    lines: list[str] = []
    for name, err in errors.items():
        lines += ["", f"## Error in {name}", "", "```", err.rstrip(), "```"]
    return lines


def write(out: str | Path, name: str, doc: dict, lines: Sequence[str], echo: bool = True) -> str:
    """``doc`` to ``out/name.json`` and ``lines`` to ``out/name.md``; the page printed too."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    md = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(md)
    if echo:
        print(md, flush=True)
    return md
