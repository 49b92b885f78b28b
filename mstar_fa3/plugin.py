"""Entry point ``fa3`` (group ``mstar.backends``) of the mstar-fa3 distribution. Registers the
backend as data; imports no kernel library."""

from __future__ import annotations

import torch

from mstar_core.plugin import BackendSpec, HeadDims, hookimpl

# flash_attn_with_kvcache's window_size and sinks arguments on every paged path. Not soft-cap: the
# known prebuilt (tokenspeed-fa3 3.0.0) is compiled with FLASHATTENTION_DISABLE_SOFTCAP (every kernel
# instance Has_softcap=false) and refuses softcap != 0. Not FP8 KV: the kernel takes FP8 K/V only
# with FP8 queries (one dtype for q, k and v).
PAGED_FEATURES = ("sink_logits", "layer_windows")

FA3 = BackendSpec(
    name="fa3",
    provides={
        "paged_prefill": "mstar_fa3.paged:FA3PrefillWrapper",
        "paged_decode": "mstar_fa3.paged:FA3DecodeWrapper",
        "mixed": "mstar_fa3.paged:FA3MixedWrapper",
        "prefixed_ragged": "mstar_fa3.ragged:FA3PrefixedPrefillWrapper",
    },
    devices=("cuda",),
    # FA3 is Hopper's kernel; the known prebuilt (tokenspeed-fa3) is compiled with
    # FLASHATTENTION_DISABLE_SM8x. The probe's tiny call confirms it on the device.
    archs=("sm90",),
    dtypes=(torch.float16, torch.bfloat16),
    # flash_attn_interface rounds head dims up to its compiled buckets (64..256) and needs
    # multiples of 8.
    head_dims=HeadDims(multiple_of=8, maximum=256),
    # The paged prefill and decode wrappers keep every tensor the kernel reads in static buffers
    # (graph mode); mixed steps and the dense path run eagerly (their shapes change every step).
    capturable=("paged_prefill", "paged_decode"),
    # Multi-token decode rows run on the decode wrapper (q [rows, t, Hq, D], causal).
    features={
        "paged_prefill": PAGED_FEATURES,
        "paged_decode": (*PAGED_FEATURES, "multi_token_decode"),
        "mixed": PAGED_FEATURES,
        # An FP8 KV cache reaches the dense path's wrappers dequantised (the dense manager does it).
        "prefixed_ragged": ("sink_logits", "layer_windows"),
    },
    probe="mstar_fa3.probe:probe",
    description="FlashAttention-3 paged prefill/decode/mixed and varlen prefill (Hopper)",
    install_hint="pip install tokenspeed-fa3 (or build flash-attention's hopper/ from source)",
    # Median kernel times on the H200 (bench/paged_backends.py): auto's order between paged backends.
    measured="mstar_fa3.measured:table",
    # auto: first on the dense path where it runs (sm90); the paged group keeps the default (0),
    # behind FlashInfer, unless the measured tables put it first.
    priority={"prefixed_ragged": 300},
    api_version="2.0",
)


@hookimpl
def mstar_register_backends(register):
    register(FA3)
