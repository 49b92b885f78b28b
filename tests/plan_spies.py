"""Spy wrappers: the reference paged wrappers, each recording the size it was built for, the plan
it keeps (whichever contract version handed it over) and every run (wrapper, plan, KV layer,
keywords), for what the managers hand a backend that the reference's outputs cannot show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mstar_core.attention.plans import PagedPlan, WrapperSize
from mstar_core.backends import reference as R


@dataclass(frozen=True)
class Run:
    wrapper: Any
    plan: PagedPlan
    layer: torch.Tensor  # the kv_cache_layer it read
    kw: dict[str, Any]


SIZES: list[tuple[str, WrapperSize]] = []  # (kind, size) per wrapper built
PLANS: list[tuple[Any, PagedPlan]] = []
RUNS: list[Run] = []


def spy(base: type, name: str) -> type:
    """``base`` recording into SIZES, PLANS and RUNS (not for graph mode: a padded run records twice)."""

    def from_size(cls, size):
        SIZES.append((base.kind, size))
        return base.from_size.__func__(cls, size)

    def _plan(self, p):
        base._plan(self, p)  # plan() of 2.0 and of 1.x both end here, with the checked plan
        self.kept = p
        PLANS.append((self, p))

    def run(self, q, kv_cache_layer, **kw):
        RUNS.append(Run(self, self.kept, kv_cache_layer, kw))
        return base.run(self, q, kv_cache_layer, **kw)

    return type(name, (base,), {"from_size": classmethod(from_size), "_plan": _plan, "run": run})


SPIES = {
    "paged_prefill": spy(R.ReferencePrefillWrapper, "SpyPrefillWrapper"),
    "paged_decode": spy(R.ReferenceDecodeWrapper, "SpyDecodeWrapper"),
    "mixed": spy(R.ReferenceMixedWrapper, "SpyMixedWrapper"),
}


def clear() -> None:
    SIZES.clear()
    PLANS.clear()
    RUNS.clear()
