"""Attention managers and the wrapper protocols backends implement."""

from mstar_core.attention.base import AttentionManager
from mstar_core.attention.protocols import MixedWrapper, PagedDecodeWrapper, PagedPrefillWrapper, PrefixedPrefillWrapper

__all__ = ["AttentionManager", "MixedWrapper", "PagedDecodeWrapper", "PagedPrefillWrapper", "PrefixedPrefillWrapper"]
