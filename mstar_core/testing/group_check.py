"""``mstar check NAME --layer-windows ... --sink-logits ...``: the conformance suite per layer
group (:mod:`mstar_core.attention.groups`). Each group's paged capabilities are selected as the
paged manager selects them (``NAME``: a backend name or ``auto``), and each pick's capabilities
are checked at that group's features: its window and the features it asks, reported per group."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar_core.attention.groups import LayerGroup, layer_groups
from mstar_core.capabilities import FEATURE_REACH, PAGED
from mstar_core.features import AttentionFeatures
from mstar_core.testing.check import Check, Report, Result, check_given, device_notes, plan_checks, run_check


@dataclass
class GroupReport:
    """One report per (layer group, backend picked for some of its capabilities)."""

    requested: str
    parts: list[tuple[LayerGroup, str, tuple[str, ...], Report]]

    @property
    def ok(self) -> bool:
        return bool(self.parts) and all(r.ok for *_, r in self.parts)

    def render(self, all_rows: bool = True) -> str:
        out = []
        for g, name, caps, r in self.parts:
            out += [f"layer group {g.describe()}: {', '.join(caps)} from {name}", r.render(all_rows), ""]
        bad = [f"{g.describe()} on {name}" for g, name, _, r in self.parts if not r.ok]
        out.append(f"mstar check {self.requested}: {len(self.parts) - len(bad)} of {len(self.parts)} (group, backend) "
                   "parts passed" + (f"; failed: {'; '.join(bad)}" if bad else ""))
        return "\n".join(out)

    def as_json(self) -> dict[str, Any]:
        return {"requested": self.requested, "ok": self.ok,
                "groups": [{"layers": list(g.layers), "window": g.window, "sink_logits": g.sink_logits,
                            "backend": name, "capabilities": list(caps), **r.as_json()}
                           for g, name, caps, r in self.parts]}


def asked(group: LayerGroup, capability: str) -> tuple[str, ...]:
    """The features a group asks that reach ``capability``: what its feature cases exercise."""
    return tuple(f for f in group.features.requested() if capability in FEATURE_REACH[f])


def check_groups(name: str, features: AttentionFeatures, device: torch.device | str | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, head_dims: Sequence[int] | None = None,
                 registry: Any = None, config: Any = None, quick: bool = False,
                 on_result: Callable[[Result], None] | None = None,
                 on_start: Callable[[Sequence[Check]], None] | None = None) -> GroupReport:
    """The suite per layer group of ``features`` (one group without per-layer values): each
    group's paged picks for ``name`` (a backend or ``auto``), each pick's capabilities checked
    at the group's window and asked features. Raises ``BackendUnavailable`` naming the group
    no backend serves."""
    from mstar_core.errors import BackendUnavailable
    from mstar_core.registry import get_registry, select_backend
    from mstar_core.registry.device import as_device

    registry = registry or get_registry()
    dev = as_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    groups = layer_groups(features, features.per_layer_count() or 1)
    planned: list[tuple[LayerGroup, str, tuple[str, ...], Any, list[Check]]] = []
    for g in groups:
        try:
            sel = select_backend(capabilities=PAGED, requested=name, device=dev, dtype=None, head_dim=None,
                                 registry=registry, honor_env=False, config=config, features=g.features)
        except BackendUnavailable as e:
            raise BackendUnavailable(f"{g.describe()}: {e}", requested=e.requested, reasons=e.reasons,
                                     available=e.available, known=e.known) from e
        for backend in dict.fromkeys(sel.names.values()):
            caps = tuple(c for c in PAGED if sel.names[c] == backend)
            spec = sel.backend_for(caps[0])
            check_given(spec, dtypes, head_dims)
            checks = plan_checks(spec, {c: sel.classes[c] for c in caps}, dev, dtypes, head_dims, quick,
                                 features={c: asked(g, c) for c in caps}, window=g.window)
            planned.append((g, backend, caps, spec, checks))
    if on_start is not None:
        on_start([c for *_, checks in planned for c in checks])
    parts = []
    for g, backend, caps, spec, checks in planned:
        results = []
        for check in checks:
            results.append(run_check(check))
            if on_result is not None:
                on_result(results[-1])
        parts.append((g, backend, caps, Report(backend, spec.label, spec.api_version, str(dev), results, {},
                                               device_notes(dev))))
    return GroupReport(name, parts)
