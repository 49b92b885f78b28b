"""The one place that imports FlashInfer, lazily: the plugin's entry-point module imports no kernel
library, and a test's stand-in injected into ``sys.modules`` is found here at construction time."""

from __future__ import annotations

import importlib
from types import ModuleType


def flashinfer() -> ModuleType:
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:  # name the distribution, not just the module
        raise ImportError(
            f"the FlashInfer backend needs the flashinfer-python package (import flashinfer failed: {e})"
        ) from e
