"""Layer groups: the layers of a model that ask the same of attention, each selected apart.

A layer's ask is its window (``features.layer_windows[i]``, -1 full) and whether it has sink
logits (``features.sink_logits``). Head dim does not split groups: the paged KV layout holds one
shape for every layer (``KVConfig`` has one ``head_dim``). Each group's selection is made with
the model's features narrowed to that group's uniform window and sink need, so one layer's need
never decides another's backend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from mstar_core.capabilities import PAGED
from mstar_core.errors import BackendUnavailable
from mstar_core.features import AttentionFeatures

log = logging.getLogger("mstar.registry")


@dataclass(frozen=True)
class LayerGroup:
    """Layers that ask the same: their window (-1 full), their sink need, and the features a
    selection for them uses (the model's, with this window and sink need on every layer)."""

    layers: tuple[int, ...]
    window: int
    sink_logits: bool
    features: AttentionFeatures

    def describe(self) -> str:
        """``layers 0,2 (window 128, sink logits)``."""
        what = "full" if self.window == -1 else f"window {self.window}"
        return f"layers {','.join(map(str, self.layers))} ({what}{', sink logits' if self.sink_logits else ''})"


def layer_groups(features: AttentionFeatures, num_layers: int) -> tuple[LayerGroup, ...]:
    """The groups of ``num_layers`` layers, in first-layer order. Without per-layer windows every
    layer uses the step's window: the groups split on sink logits alone (window -1)."""
    features.check_layers(num_layers, "layer_groups")
    keys: dict[tuple[int, bool], list[int]] = {}
    for i in range(num_layers):
        keys.setdefault((features.window(i, -1), features.layer_sinks(i)), []).append(i)
    windows = features.layer_windows
    return tuple(LayerGroup(tuple(layers), w, s, replace(
        features, sink_logits=s, layer_windows=None if windows is None else (w,) * num_layers))
        for (w, s), layers in keys.items())


@dataclass(frozen=True)
class GroupSelection:
    """Each group's selection; ``whole`` is the one selection for every layer where one manager
    serves the model (one group, or every group's picks equal the whole model's)."""

    groups: tuple[tuple[LayerGroup, Any], ...]
    whole: Any = None

    @property
    def split(self) -> bool:
        return self.whole is None


def same_picks(a: Any, b: Any) -> bool:
    """Whether two selections take the same backend per capability and run multi-token rows alike."""
    return bool(a.names == b.names and a.multi_token_wrapper == b.multi_token_wrapper)


def why(sel: Any) -> str:
    """What a group's selection passed over, for the log: ``name: reason; ... | name: ...``."""
    from mstar_core.registry.selection import format_rejected

    return format_rejected(sel.rejected) or "first choice"


def select_groups(features: AttentionFeatures, num_layers: int, capabilities: Sequence[str] = PAGED,
                  whole_features: AttentionFeatures | None = None, **select: Any) -> GroupSelection:
    """Select ``capabilities`` per layer group of ``features`` (``select``: :func:`select_backend`'s
    other keywords, the same for every group); the whole model's selection is made with
    ``whole_features`` (None: ``features``). Raises ``BackendUnavailable`` naming the group no
    backend serves."""
    from mstar_core.registry import select_backend

    groups = layer_groups(features, num_layers)
    whole_features = features if whole_features is None else whole_features
    if len(groups) == 1:
        sel = select_backend(capabilities=capabilities, features=whole_features, **select)
        return GroupSelection(((groups[0], sel),), sel)
    try:
        whole = select_backend(capabilities=capabilities, features=whole_features, **select)
    except BackendUnavailable:
        whole = None
    picks = []
    for g in groups:
        try:
            picks.append((g, select_backend(capabilities=capabilities, features=g.features, **select)))
        except BackendUnavailable as e:
            raise BackendUnavailable(f"{g.describe()}: {e}", requested=e.requested, reasons=e.reasons,
                                     available=e.available, known=e.known) from e
    if whole is not None and all(same_picks(sel, whole) for _, sel in picks):
        return GroupSelection(tuple(picks), whole)
    log.info("layer groups: %s", "; ".join(f"{g.describe()} -> {sel.summary} ({why(sel)})" for g, sel in picks))
    return GroupSelection(tuple(picks))
