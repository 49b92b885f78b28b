"""Attention managers and the wrapper protocols backends implement."""

from .base import AttentionManager
from .protocols import MixedWrapper, PagedDecodeWrapper, PagedPrefillWrapper, PrefixedPrefillWrapper

__all__ = ["AttentionManager", "MixedWrapper", "PagedDecodeWrapper", "PagedPrefillWrapper", "PrefixedPrefillWrapper"]
