"""mstar-flashinfer: FlashInfer's paged prefill, paged decode, mixed and ragged prefill kernels
as mstar attention backend "flashinfer".

Importing this package imports no kernel library (the registry imports it at discovery time on
every machine, GPU or not). The wrapper names below resolve lazily, on first attribute access;
``flashinfer`` itself is imported when a wrapper is built.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> submodule defining it, loaded on first access (PEP 562).
_LAZY: dict[str, str] = {
    "FlashInferPrefillWrapper": "mstar_flashinfer.prefill",
    "FlashInferDecodeWrapper": "mstar_flashinfer.decode",
    "FlashInferMixedWrapper": "mstar_flashinfer.mixed",
    "FlashInferPrefixedPrefillWrapper": "mstar_flashinfer.ragged",
    "check_flashinfer_head_dim": "mstar_flashinfer.head_dim",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
