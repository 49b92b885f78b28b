"""Attention managers (paged, dense) and the wrapper protocols backends implement."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mstar_core.attention.grouped import GroupedPagedAttentionManager, GroupedPlan
    from mstar_core.attention.paged import build_paged_attention

_GROUPED = ("GroupedPagedAttentionManager", "GroupedPlan", "build_paged_attention")


def __getattr__(name: str) -> Any:
    # loaded on first use: mstar_core.features imports this package before the managers exist
    if name in _GROUPED:
        from mstar_core.attention import grouped, paged

        return getattr(paged if name == "build_paged_attention" else grouped, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GroupedPagedAttentionManager", "GroupedPlan", "build_paged_attention"]
