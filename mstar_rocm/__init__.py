"""mstar-rocm: AITER's varlen flash attention as mstar's prefixed ragged (dense) wrapper on
ROCm, attention backend "rocm".

Importing this package imports no kernel library: ``aiter`` is imported when a wrapper is
built. ``AiterPrefixedPrefillWrapper`` resolves lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {"AiterPrefixedPrefillWrapper": "mstar_rocm.ragged"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
