"""The plain-PyTorch reference backend: runs on CPU and GPU, the oracle every backend is
tested against, and the default where no kernel library runs."""

from mstar_core.backends.reference.dense import ReferencePrefixedPrefillWrapper
from mstar_core.backends.reference.paged import ReferenceDecodeWrapper, ReferenceMixedWrapper, ReferencePrefillWrapper

__all__ = [
    "ReferenceDecodeWrapper",
    "ReferenceMixedWrapper",
    "ReferencePrefillWrapper",
    "ReferencePrefixedPrefillWrapper",
]
