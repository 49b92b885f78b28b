"""Can FlashInfer run here: is ``flashinfer`` installed, and is it 0.5 or newer. The device
and architecture come from the backend's declared data (checked by the registry).

No tiny call: FlashInfer JIT-compiles each kernel on first use (17-80 s per module on an H200),
far too slow for a probe that every ``mstar backends`` and every ``auto`` runs. A broken
install shows when the wrapper is built instead.
"""

from __future__ import annotations

import torch

from mstar_core.registry.probing import module_missing, version_too_old

MODULE = "flashinfer"
DISTRIBUTIONS = ("flashinfer-python", "flashinfer")
MIN_VERSION = "0.5"
INSTALL = f"flashinfer-python>={MIN_VERSION}"


def probe(device: torch.device) -> list[str]:
    """Reasons FlashInfer cannot run on ``device`` beyond the declared ones; empty if it can."""
    return module_missing(MODULE, INSTALL) or version_too_old(DISTRIBUTIONS, MIN_VERSION, MODULE)
