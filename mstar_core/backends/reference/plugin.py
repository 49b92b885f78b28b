"""The built-in reference backend, registered through the same hook as every plugin
(entry point ``reference`` in mstar-core's pyproject). Plain PyTorch: every capability, on CPU
and GPU, in every float dtype and head dim, and the fallback ``auto`` ends with."""

from __future__ import annotations

import torch

from mstar_core.registry.hookspecs import hookimpl
from mstar_core.registry.spec import BackendSpec

PAGED_FEATURES = ("fp8_e4m3", "fp8_e5m2", "soft_cap", "sink_logits", "layer_windows")

REFERENCE = BackendSpec(
    name="reference",
    provides={
        "paged_prefill": "mstar_core.backends.reference:ReferencePrefillWrapper",
        "paged_decode": "mstar_core.backends.reference:ReferenceDecodeWrapper",
        "mixed": "mstar_core.backends.reference:ReferenceMixedWrapper",
        "prefixed_ragged": "mstar_core.backends.reference:ReferencePrefixedPrefillWrapper",
        "bounded": "mstar_core.kernels.bounded_attention:bounded_attention",
    },
    devices=("cpu", "cuda", "rocm"),
    dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16),
    # Eager only: plan() rebuilds its index tensors, so a captured graph would read stale ones.
    capturable=(),
    # Every feature, as the float64 oracle defines it (the bounded kernels take none of them:
    # the bounded manager refuses them with its own reason).
    # Multi-token decode rows on either wrapper (plugin API 1.1: declared where they run): its
    # decode wrapper takes them, and its prefill wrapper runs them for a decode pick that does not.
    features={
        "paged_prefill": (*PAGED_FEATURES, "multi_token_decode"),
        "paged_decode": (*PAGED_FEATURES, "multi_token_decode"),
        "mixed": PAGED_FEATURES,
        "prefixed_ragged": ("soft_cap", "sink_logits", "layer_windows"),
    },
    description="plain PyTorch; the oracle every backend is tested against",
    api_version="2.0",
)


@hookimpl
def mstar_register_backends(register):
    register(REFERENCE)
