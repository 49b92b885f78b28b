"""Entry point ``rocm`` (group ``mstar.backends``) of the mstar-rocm distribution. Registers
the backend as data; imports no kernel library."""

from __future__ import annotations

import torch

from mstar_core.plugin import BackendSpec, HeadDims, hookimpl

AITER = BackendSpec(
    name="rocm",
    provides={"prefixed_ragged": "mstar_rocm.ragged:AiterPrefixedPrefillWrapper"},
    devices=("rocm",),
    archs=("gfx942", "gfx950"),  # MI300 / MI350: the architectures AITER's CK kernels target
    dtypes=(torch.float16, torch.bfloat16),
    # aiter.flash_attn_varlen_func pads head dims to a multiple of 8 itself; CK tiles stop at 256.
    head_dims=HeadDims(maximum=256),
    capturable=(),  # the dense path runs eagerly: its shapes change every step
    priority=200,  # auto: the dense path on ROCm (FA3, 300, and FlashInfer, 100, run on CUDA)
    probe="mstar_rocm.probe:probe",
    description="AITER (ROCm) varlen flash attention",
    install_hint="pip install amd-aiter",
    api_version="2.0",
)


@hookimpl
def mstar_register_backends(register):
    register(AITER)
