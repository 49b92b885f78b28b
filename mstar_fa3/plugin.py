"""Entry point ``fa3`` (group ``mstar.backends``) of the mstar-fa3 distribution. Registers the
backend as data; imports no kernel library."""

from __future__ import annotations

import torch

from mstar_core.registry import BackendSpec, HeadDims, hookimpl

FA3 = BackendSpec(
    name="fa3",
    provides={"prefixed_ragged": "mstar_fa3.ragged:FA3PrefixedPrefillWrapper"},
    devices=("cuda",),
    # FA3 is Hopper's kernel; the known prebuilt (tokenspeed-fa3) is compiled with
    # FLASHATTENTION_DISABLE_SM8x. The probe's tiny call confirms it on the device.
    archs=("sm90",),
    dtypes=(torch.float16, torch.bfloat16),
    # flash_attn_interface rounds head dims up to its compiled buckets (64..256) and needs
    # multiples of 8.
    head_dims=HeadDims(multiple_of=8, maximum=256),
    capturable=(),  # the dense path runs eagerly: its shapes change every step
    # flash_attn_varlen_func's window_size and sinks arguments. Not soft-cap: the known prebuilt
    # (tokenspeed-fa3 3.0.0) is compiled with FLASHATTENTION_DISABLE_SOFTCAP (every kernel instance
    # Has_softcap=false) and refuses softcap != 0. An FP8 KV cache reaches the dense path's wrappers
    # dequantised (the dense manager does it), so it is not asked of them.
    features={"prefixed_ragged": ("sink_logits", "layer_windows")},
    probe="mstar_fa3.probe:probe",
    description="FlashAttention-3 varlen prefill (Hopper)",
    install_hint="pip install tokenspeed-fa3 (or build flash-attention's hopper/ from source)",
)


@hookimpl
def mstar_register_backends(register):
    register(FA3)
