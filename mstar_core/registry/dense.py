"""``dense_or_flashinfer(device)``: which prefixed ragged wrapper the dense path runs.

FA3 where FA3 has a kernel for the GPU (sm90, confirmed by its probe's tiny call), AITER on ROCm
(gfx942 / gfx950), FlashInfer's ragged prefill elsewhere on CUDA, the reference where none of
them is installed or runs. "Has a kernel" is decided by each backend's probe, not by name; the
registry caches probes per device and this module caches the answer per (device, dtype,
head_dim, features). A model's features are asked of ``prefixed_ragged`` as
``capabilities.FEATURE_REACH`` says: soft-cap, sink logits and per-layer windows are, an FP8 KV
cache is not (the dense manager dequantises its prefix, so the wrappers read the model dtype).
``DenseAttentionManager.build`` selects through ``select_backend`` with the same rule, where a
named backend and ``MSTAR_ATTENTION_BACKEND`` apply as well.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mstar_core.errors import InputTypeError
from mstar_core.features import PLAIN, AttentionFeatures
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
    features: AttentionFeatures | None = None,
) -> Selection:
    """The auto selection for the dense path, with every passed-over backend's reasons.
    ``dtype``/``head_dim`` None judge the device alone; ``features`` (None: plain attention)
    are what the model asks for, refused by a backend that does not declare those that reach
    ``prefixed_ragged``. Raises ``BackendUnavailable`` when no backend can serve them."""
    if features is not None and not isinstance(features, AttentionFeatures):
        raise InputTypeError(f"features must be an AttentionFeatures or None, got {type(features).__name__}")
    device = as_device(device)
    registry = registry or get_registry()
    features = features or PLAIN

    def select() -> Selection:
        # requested="auto", env ignored, on purpose: this is the rule itself. A named backend, and
        # the operator's MSTAR_ATTENTION_BACKEND, apply where a manager selects
        # (DenseAttentionManager.build).
        sel = select_backend(capabilities=(CAPABILITY,), requested="auto", device=device, dtype=dtype,
                             head_dim=head_dim, registry=registry, honor_env=False, features=features)
        log.info("dense_or_flashinfer(%s): %s (%s)%s", device_key(device), sel.name, sel.backend.label,
                 f"; passed over {format_rejected(sel.rejected)}" if sel.rejected else "")
        return sel

    # Cached on the registry: a new registry (reset_registry) or clear_probe_cache() starts afresh.
    # Selection reads only which features are asked for, not their values (scales, the cap).
    return registry.derived((CAPABILITY, device_key(device), dtype, head_dim, features.requested()), select)


def dense_or_flashinfer(
    device: torch.device | str | None,
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    registry: Registry | None = None,
    features: AttentionFeatures | None = None,
) -> Any:
    """The prefixed ragged wrapper class for ``device`` (see the module doc for the rule)."""
    return dense_selection(device, dtype, head_dim, registry, features).classes[CAPABILITY]
