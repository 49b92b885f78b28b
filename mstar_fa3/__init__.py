"""mstar-fa3: FlashAttention-3 as mstar's paged prefill, decode and mixed wrappers
(``flash_attn_with_kvcache``) and its prefixed ragged (dense) wrapper (``flash_attn_varlen_func``),
attention backend "fa3".

Importing this package imports no kernel library: ``flash_attn_interface`` is imported by the
probe (on an sm90 GPU) or when a wrapper is built. The wrapper classes resolve lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "FA3PrefixedPrefillWrapper": "mstar_fa3.ragged",
    "FA3PrefillWrapper": "mstar_fa3.paged",
    "FA3DecodeWrapper": "mstar_fa3.paged",
    "FA3MixedWrapper": "mstar_fa3.paged",
}

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
