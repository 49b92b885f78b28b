"""Can AITER run here: is ``aiter`` installed. The ROCm device and its architecture
(gfx942 / gfx950) come from the backend's declared data, checked by the registry.

No tiny call: AITER builds its CK attention modules on first use (JIT, minutes), too slow for a
probe run by every ``mstar backends`` and ``auto``; a broken install shows when the wrapper is
built.
"""

from __future__ import annotations

import torch

from mstar_core.plugin import module_missing

MODULE = "aiter"
INSTALL = "amd-aiter"


def probe(device: torch.device) -> list[str]:
    return module_missing(MODULE, INSTALL)
