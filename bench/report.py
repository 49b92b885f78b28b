"""What every benchmark here writes: the environment it ran in (device, torch, CUDA, Python, the
kernel libraries' versions, the commit), its figures as JSON, and a markdown page of tables with
each target and whether it was met.

The environment record is :mod:`mstar_core.testing.environment` (the GPU tests write it too).
Scripts import this module as ``import report`` (``python3 bench/x.py`` puts bench/ on the path).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# re-exported: the scripts record their environment through this module
from mstar_core.testing.environment import LIBRARIES as LIBRARIES
from mstar_core.testing.environment import commit as commit
from mstar_core.testing.environment import dist_version as dist_version
from mstar_core.testing.environment import environment as environment


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


def measured(res: dict, name: str, fn: Callable[[], dict]) -> None:
    """``res[name] = fn()`` with its wall seconds (``wall_s``); an exception is recorded as
    ``res[name]["error"]`` (one part's failure is a result: the others still run)."""
    t0 = time.perf_counter()
    try:
        res[name] = fn()
    except Exception as e:
        res.setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"[:800]
        traceback.print_exc()
    res.setdefault(name, {})["wall_s"] = time.perf_counter() - t0


def finish(out: str | Path | None, name: str, doc: dict, title: str, body: Sequence[str]) -> int:
    """The page (``title``, the environment line, ``body``) written with ``doc`` under ``out``,
    or printed where there is none; the script's exit status."""
    lines = [f"# {title}", "", environment_line(doc["env"]), "", *body]
    if out:
        write(out, name, doc, lines)
    else:
        print("\n".join(lines))
    return 0
