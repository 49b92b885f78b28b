"""``dense_or_flashinfer(device)``: which prefixed ragged wrapper the dense path runs.

FA3 where FA3 has a kernel for the GPU (sm90, confirmed by its probe's tiny call), AITER on ROCm
(gfx942 / gfx950), FlashInfer's ragged prefill elsewhere on CUDA, the reference where none of
them is installed or runs. "Has a kernel" is decided by each backend's probe, not by name; the
registry caches probes per device and this module caches the answer per (device, dtype,
head_dim). ``AttentionManager.build`` passes the returned class.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mstar_core.registry import Registry, Selection, get_registry, select_backend
from mstar_core.registry.device import as_device, device_key
from mstar_core.registry.selection import format_rejected

log = logging.getLogger("mstar.registry")

CAPABILITY = "prefixed_ragged"


def dense_selection(
    device: torch.device | str | None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    registry: Registry | None = None,
) -> Selection:
    """The auto selection for the dense path, with every passed-over backend's reasons.
    ``dtype``/``head_dim`` None judge the device alone."""
    device = as_device(device)
    registry = registry or get_registry()

    def select() -> Selection:
        # requested="auto", env ignored, on purpose: this is the rule itself. A named backend, and
        # the operator's MSTAR_ATTENTION_BACKEND, apply where a manager selects
        # (DenseAttentionManager.build).
        sel = select_backend(capabilities=(CAPABILITY,), requested="auto", device=device, dtype=dtype,
                             head_dim=head_dim, registry=registry, honor_env=False)
        log.info("dense_or_flashinfer(%s): %s (%s)%s", device_key(device), sel.name, sel.backend.label,
                 f"; passed over {format_rejected(sel.rejected)}" if sel.rejected else "")
        return sel

    # Cached on the registry: a new registry (reset_registry) or clear_probe_cache() starts afresh.
    return registry.derived((CAPABILITY, device_key(device), dtype, head_dim), select)


def dense_or_flashinfer(
    device: torch.device | str | None,
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    registry: Registry | None = None,
) -> Any:
    """The prefixed ragged wrapper class for ``device`` (see the module doc for the rule)."""
    return dense_selection(device, dtype, head_dim, registry).classes[CAPABILITY]

