"""The plain-PyTorch reference backend: runs on CPU and GPU, the oracle every backend is
tested against, and the default where no kernel library runs."""

from .paged import ReferenceDecodeWrapper, ReferenceMixedWrapper, ReferencePrefillWrapper
from .ragged import ReferencePrefixedPrefillWrapper

__all__ = [
    "ReferenceDecodeWrapper",
    "ReferenceMixedWrapper",
    "ReferencePrefillWrapper",
    "ReferencePrefixedPrefillWrapper",
]
