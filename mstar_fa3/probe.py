"""Does FA3 have a kernel for this GPU: decided by probing, not by name. The module
must be installed; on an sm90 device (the only architecture the declared data admits) it is
imported and one tiny varlen call runs, so a build compiled for another architecture, or one
whose extension fails to load, is refused here with its error rather than at the first step.
The registry caches the answer per device.
"""

from __future__ import annotations

import importlib

import torch

from mstar_core.plugin import device_arch, device_kind, module_missing

MODULE = "flash_attn_interface"
ARCHS = ("sm90",)
INSTALL = "a FlashAttention-3 build providing flash_attn_interface (e.g. pip install tokenspeed-fa3)"


def tiny_call(device: torch.device) -> list[str]:
    """One 2-token varlen call on ``device``; reasons if it fails or returns garbage."""
    try:
        fa3 = importlib.import_module(MODULE)
        q = torch.randn((2, 1, 64), device=device, dtype=torch.bfloat16)
        cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
        out = fa3.flash_attn_varlen_func(q, q, q, cu, cu, 2, 2, causal=True)
        out = out[0] if isinstance(out, (tuple, list)) else out  # builds differ: out or (out, lse)
        if tuple(out.shape) != (2, 1, 64) or not bool(torch.isfinite(out).all()):
            return [f"FA3 tiny call on {device} returned a wrong or non-finite result (shape {tuple(out.shape)})"]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # any failure means "no usable kernel here"; say which
        return [f"FA3 has no working kernel on {device_arch(device) or device}: "
                f"tiny call failed ({type(e).__name__}: {e})"]
    return []


def probe(device: torch.device) -> list[str]:
    reasons = module_missing(MODULE, INSTALL)
    if reasons:
        return reasons
    # Elsewhere the registry already reports the device or architecture; only run where it counts.
    if device_kind(device) != "cuda" or not torch.cuda.is_available() or device_arch(device) not in ARCHS:
        return []
    return tiny_call(device)
