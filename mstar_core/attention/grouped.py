"""Paged attention over layer groups that take different backends:
:class:`GroupedPagedAttentionManager`, one :class:`~mstar_core.attention.paged.PagedAttentionManager`
per layer group (:mod:`.groups`) over the same KV manager, each with its own backend, wrappers
and graphs (``build_paged_attention`` in :mod:`.paged` makes one where a model needs it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mstar_core.attention.base import AttentionManager
from mstar_core.attention.groups import LayerGroup
from mstar_core.capabilities import PAGED
from mstar_core.errors import InputError
from mstar_core.features import AttentionFeatures
from mstar_core.kv.paged import KVManager
from mstar_core.step import Step, StepContext

if TYPE_CHECKING:  # paged.py builds this class's instances: it imports this module
    from mstar_core.attention.paged import PagedAttentionManager, PagedAttnPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupedPlan:
    """One step's plan per layer group, in the groups' order."""

    plans: tuple[PagedAttnPlan, ...]
    kv_plan: Any = field(default=None, compare=False, repr=False)


class GroupedPagedAttentionManager(AttentionManager):
    """Paged attention where layer groups take different backends: ``plan`` plans every group's
    manager, ``run(layer_idx=i)`` runs layer i's. What a runner asks of a manager (capture,
    pre-planning, graph buffers, fingerprint, cleanup) it asks of every group's."""

    def __init__(self, kv_cache: KVManager, groups: Sequence[tuple[LayerGroup, PagedAttentionManager]],
                 features: AttentionFeatures | None = None) -> None:
        n = kv_cache.config.num_layers
        owner: dict[int, PagedAttentionManager] = {}
        for g, m in groups:
            if m.kv is not kv_cache:
                raise InputError(f"GroupedPagedAttentionManager: the manager of {g.describe()} is built over another "
                                 "KV manager; build every group's over this one")
            for i in g.layers:
                if i in owner or not 0 <= i < n:
                    raise InputError(f"GroupedPagedAttentionManager: layer {i} of {g.describe()} is "
                                     f"{'in two groups' if i in owner else f'not a layer (0..{n - 1})'}; every "
                                     "layer must be in exactly one group")
                owner[i] = m
        if len(owner) != n:
            raise InputError(f"GroupedPagedAttentionManager: layers {sorted(set(range(n)) - set(owner))} are in no "
                             "group; every layer must be in exactly one group")
        self.kv = kv_cache
        self.features = kv_cache.features if features is None else features
        self.groups = tuple(g for g, _ in groups)
        self.managers = tuple(m for _, m in groups)
        self._by_layer = tuple(owner[i] for i in range(n))
        first = self.managers[0]
        self.device, self.dtype, self.kv_config = first.device, first.dtype, first.kv_config
        self.backend_name = "+".join(dict.fromkeys(b for m in self.managers for b in m.backend_names.values() if b))
        # capability -> the backends serving it across the groups
        self.backend_names = {c: "+".join(dict.fromkeys(str(m.backend_names.get(c)) for m in self.managers))
                              for c in PAGED}
        self._current: GroupedPlan | None = None

    @property
    def accelerator_graph(self) -> bool:
        return all(m.accelerator_graph for m in self.managers)

    def describe(self) -> str:
        """``layers 0,2 (window 128): fa3; layers 1,3 (full): reference``."""
        return "; ".join(f"{g.describe()}: {m.describe()}" for g, m in zip(self.groups, self.managers, strict=True))

    # -- step ----------------------------------------------------------------------------------
    def plan(self, step: Step, ctx: StepContext) -> GroupedPlan:
        plans = tuple(m.plan(step, ctx) for m in self.managers)
        self._current = GroupedPlan(plans, ctx.plan_results[self.kv.name])
        return self._current

    def enter_plan(self, plan: Any) -> None:
        # every group's layers read their own manager's part of the bound step's plan
        super().enter_plan(plan)
        for m, p in zip(self.managers, plan.plans, strict=True):
            m.enter_plan(p)

    def exit_plan(self) -> None:
        for m in self.managers:
            m.exit_plan()
        super().exit_plan()

    def manager_for(self, layer_idx: int | None) -> PagedAttentionManager:
        """The manager of ``layer_idx``'s group."""
        if layer_idx is None:
            raise InputError("GroupedPagedAttentionManager.run: layer groups take different backends: run needs "
                             "layer_idx")
        return self._by_layer[self.kv.check_layer(layer_idx)]

    def run(
        self,
        q: torch.Tensor,
        label: str | None = None,
        kv_cache_layer: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        layer_idx: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``layer_idx`` on its group's manager (under ``torch.compile``: that manager's op)."""
        return self.manager_for(layer_idx).run(q, label, kv_cache_layer, k, v, layer_idx, sinks)

    def run_eager(self, q: torch.Tensor, label: str | None, kv_cache_layer: torch.Tensor | None,
                  layer_idx: int | None, sinks: torch.Tensor | None, check_view: bool = True) -> torch.Tensor:
        return self.manager_for(layer_idx).run_eager(q, label, kv_cache_layer, layer_idx, sinks, check_view)

    # -- what runners ask ------------------------------------------------------------------------
    def build_accelerator_graph_buffers(self, slots: int, max_bs: int, max_seq_len: int) -> None:
        for m in self.managers:
            m.build_accelerator_graph_buffers(slots, max_bs, max_seq_len)

    def can_capture(self) -> bool:
        return all(m.can_capture() for m in self.managers)

    @property
    def supports_preplan(self) -> bool:
        return all(m.supports_preplan for m in self.managers)

    @property
    def force_double_buffer(self) -> bool:
        return any(m.force_double_buffer for m in self.managers)

    def depends_on(self) -> tuple[str, ...]:
        return (self.kv.name,)

    def fingerprint(self) -> bytes:
        # which layers each kernel serves changes what deeper layers' pages hold
        parts = [f"{','.join(map(str, g.layers))}=".encode() + (m.fingerprint() or b"")
                 for g, m in zip(self.groups, self.managers, strict=True)]
        return b"attn.grouped:" + b"|".join(parts)

    def post_warmup_validate(self) -> None:
        for m in self.managers:
            m.post_warmup_validate()

    def cleanup(self) -> None:
        for m in self.managers:
            m.cleanup()
        self._current = None


# Moved to .paged (which imports this module); the old path keeps working for one MINOR.
_MOVED = ("build_paged_attention", "summary", "PagedManager")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import warnings

        from mstar_core.attention import paged

        warnings.warn(f"mstar_core.attention.grouped.{name} moved to mstar_core.attention.paged.{name}; the old "
                      "path goes in the next MINOR", DeprecationWarning, stacklevel=2)
        return getattr(paged, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
