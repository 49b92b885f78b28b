"""Measured kernel times a backend commits beside its code (``BackendSpec.measured``), and the
order ``auto`` draws from them: among the backends that can serve a capability, those with
figures for this GPU architecture go first, fastest first, compared over the workloads both
measured (a geometric mean of their median times); the others keep their places behind them.

A table is JSON (``load_table``), written by a benchmark that timed every backend it names in
one process on one device::

    {"backend": "fa3", "arch": "sm90", "device": "NVIDIA H200", "dtype": "bfloat16",
     "source": "results/h200/paged_backends/paged_backends-<sha>.json",
     "median_ms": {"paged_decode": {"decode 64x8192": 0.53, ...}, "paged_prefill": {...}}}

Figures are of plain attention at the benchmark's head shape; a request's features, dtype and
head dim do not change the order (the backends that cannot serve them are already out).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from mstar_core.errors import InputError, InputTypeError

log = logging.getLogger("mstar.registry")


@dataclass(frozen=True)
class MeasuredTable:
    """One backend's median kernel times per capability and workload on one architecture."""

    backend: str
    arch: str
    median_ms: Mapping[str, Mapping[str, float]]
    device: str = ""
    source: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str) -> MeasuredTable:
        if not isinstance(doc, Mapping):
            raise InputTypeError(f"{where}: a measured table must be a JSON object, got {type(doc).__name__}")
        for key in ("backend", "arch", "median_ms"):
            if key not in doc:
                raise InputError(f"{where}: a measured table needs {key!r} (keys: backend, arch, median_ms, device, "
                                 "source)")
        ms = doc["median_ms"]
        if not isinstance(ms, Mapping) or not all(isinstance(v, Mapping) for v in ms.values()):
            raise InputTypeError(f"{where}: median_ms must map capability -> workload -> milliseconds")
        for cap, rows in ms.items():
            for name, v in rows.items():
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
                    raise InputError(f"{where}: median_ms[{cap!r}][{name!r}] must be a positive number of "
                                     f"milliseconds, got {v!r}")
        rest = {k: v for k, v in doc.items() if k not in ("backend", "arch", "median_ms", "device", "source")}
        return cls(str(doc["backend"]), str(doc["arch"]), {c: dict(r) for c, r in ms.items()},
                   str(doc.get("device", "")), str(doc.get("source", "")), rest)

    def figures(self, capability: str, arch: str | None) -> Mapping[str, float]:
        """workload -> median ms of ``capability`` on ``arch`` (empty: not measured there)."""
        return self.median_ms.get(capability, {}) if arch == self.arch else {}


def load_table(package: str, resource: str) -> MeasuredTable:
    """The JSON table ``resource`` shipped inside ``package`` (a plugin's own data file)."""
    where = f"{package}/{resource}"
    text = resources.files(package).joinpath(resource).read_text(encoding="utf-8")
    return MeasuredTable.from_dict(json.loads(text), where)


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def measured_order(names: Sequence[str], tables: Mapping[str, MeasuredTable], capability: str,
                   arch: str | None) -> tuple[list[str], str | None]:
    """``names`` (auto's order) with the measured ones first, fastest first; and why, for the log
    (None when fewer than two have comparable figures, which leaves the order as it was).
    Two backends are compared over the workloads both measured."""
    figs = {n: tables[n].figures(capability, arch) for n in names if n in tables}
    figs = {n: f for n, f in figs.items() if f}
    if len(figs) < 2:
        return list(names), None
    shared = set.intersection(*(set(f) for f in figs.values()))
    if not shared:
        return list(names), None
    work = sorted(shared)
    score = {n: _geomean([f[w] for w in work]) for n, f in figs.items()}
    fast = sorted(score, key=lambda n: (score[n], list(names).index(n)))
    order = fast + [n for n in names if n not in score]
    t = next(iter(tables[n] for n in fast))
    why = (f"{capability}: measured on {t.device or arch} ({', '.join(work)}): "
           + ", ".join(f"{n} {score[n]:.3g} ms" for n in fast) + f" -> {fast[0]} first"
           + (f" [{t.source}]" if t.source else ""))
    return order, why
