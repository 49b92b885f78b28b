"""How the core builds and plans a backend's wrappers, by the plugin contract version its spec
declares: the one place that decides what a wrapper of each version receives. The managers and
``mstar check`` call wrappers only through here.

- **2.0** wrappers are built with ``cls.from_size(WrapperSize)`` and planned with the checked
  plan object (``plan(PagedPlan)`` / ``plan(RaggedPlan)``).
- **1.x** wrappers keep the loose-argument calls of their version (docs/PLUGINS.md, contract 1.x):
  FlashInfer-shaped positional constructors and plan arguments. A keyword a later MINOR added
  never reaches a wrapper written for an earlier one (1.0 never gets ``sink_logits``: its wrappers
  take ``sinks`` at run alone).
"""

from __future__ import annotations

from typing import Any

from mstar_core.attention.plans import PagedPlan, RaggedPlan, WrapperSize
from mstar_core.capabilities import MIXED, PAGED_DECODE, PAGED_PREFILL
from mstar_core.registry.api import parse_api_version

PLAN_OBJECTS = (2, 0)  # the contract version whose wrappers take plan objects


def takes_plan_objects(api_version: str) -> bool:
    """Whether a wrapper of contract ``api_version`` is built from a ``WrapperSize`` and planned
    with a plan object."""
    return parse_api_version(api_version) >= PLAN_OBJECTS


def build_wrapper(cls: type, capability: str, size: WrapperSize, api_version: str) -> Any:
    """A wrapper of ``capability`` (a paged one, or prefixed_ragged) sized by ``size``."""
    if takes_plan_objects(api_version):
        return cls.from_size(size)  # type: ignore[attr-defined]
    backend = size.options.get("backend", "auto")  # 1.x: every wrapper accepts FlashInfer's option
    if capability not in (PAGED_PREFILL, PAGED_DECODE, MIXED):  # prefixed_ragged: its own workspace
        return cls(size.num_qo_heads, size.num_kv_heads, size.head_dim, size.device, backend=backend)
    common = (size.num_qo_heads, size.num_kv_heads, size.head_dim, size.page_size)
    if capability == MIXED:
        return cls(size.workspace(), size.workspace(), *common, size.batch_size, size.max_total_tokens,
                   size.max_num_pages, size.max_prefill_rows, size.device, backend=backend)
    if not size.accelerator_graph:
        return cls(size.workspace(), *common, device=size.device, backend=backend)
    extra: dict[str, Any] = {}
    ws = size.workspace()
    if capability == PAGED_PREFILL:
        extra["max_total_tokens"] = size.max_total_tokens
        # a 1.x wrapper class may ask for a larger graph-mode workspace (FlashInfer's split-KV scratch)
        factor = getattr(cls, "graph_workspace_factor", 1)
        if factor != 1:
            ws = WrapperSize(size.num_qo_heads, size.num_kv_heads, size.head_dim, size.device,
                             workspace_bytes=factor * size.workspace_bytes).workspace()
    elif size.query_tokens > 1 and parse_api_version(api_version) >= (1, 1):
        extra["query_tokens"] = size.query_tokens
    return cls(ws, *common, batch_size=size.batch_size, max_num_pages=size.max_num_pages, device=size.device,
               accelerator_graph=True, backend=backend, **extra)


def paged_keywords(plan: PagedPlan, api_version: str) -> dict[str, Any]:
    """The plan keywords a 1.x paged wrapper receives beyond its layout: those its version knows,
    only where the plan sets them."""
    kw: dict[str, Any] = {}
    if plan.sm_scale is not None:
        kw["sm_scale"] = plan.sm_scale
    if plan.logits_soft_cap is not None:
        kw["logits_soft_cap"] = plan.logits_soft_cap
    if plan.kv_data_type is not None:
        kw["kv_data_type"] = plan.kv_data_type
    if plan.sink_logits and parse_api_version(api_version) >= (1, 1):
        kw["sink_logits"] = True
    if plan.kind == PAGED_DECODE and plan.query_tokens > 1 and parse_api_version(api_version) >= (1, 1):
        kw["query_tokens"] = plan.query_tokens  # 1.0 ran multi-token rows on its prefill wrapper alone
    return kw


def plan_paged(wrapper: Any, plan: PagedPlan, api_version: str, extra: dict[str, Any] | None = None) -> None:
    """Plan ``wrapper`` with ``plan`` as its contract version takes it. ``extra``: keywords to
    pass a 1.x wrapper besides its own (``mstar check``'s unknown-keyword rule)."""
    if takes_plan_objects(api_version):
        wrapper.plan(plan)
        return
    kw = {**paged_keywords(plan, api_version), **(extra or {})}
    if plan.kind == PAGED_DECODE:
        wrapper.plan(plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, dtype=plan.dtype, kv_lens=plan.kv_lens,
                     window_left=plan.window_left, **kw)
        return
    wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, causal=plan.causal,
                 dtype=plan.dtype, kv_lens=plan.kv_lens, window_left=plan.window_left, **kw)


def plan_ragged(wrapper: Any, plan: RaggedPlan, api_version: str, extra: dict[str, Any] | None = None) -> None:
    """Plan a prefixed ragged ``wrapper`` with ``plan`` as its contract version takes it (1.x:
    ``sink_logits`` never at plan, ``sinks`` at run)."""
    if takes_plan_objects(api_version):
        wrapper.plan(plan)
        return
    kw: dict[str, Any] = {} if plan.logits_soft_cap is None else {"logits_soft_cap": plan.logits_soft_cap}
    wrapper.plan(plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, causal=plan.causal, dtype=plan.dtype,
                 sm_scale=plan.sm_scale, window_left=plan.window_left, **kw, **(extra or {}))
