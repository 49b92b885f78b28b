"""``FA3PrefixedPrefillWrapper``: the dense path's prefixed ragged prefill over
FlashAttention-3's ``flash_attn_interface.flash_attn_varlen_func`` (the shared logic is
``mstar_core.plugin.VarlenPrefixedWrapper``)."""

from __future__ import annotations

import torch

from mstar_core.plugin import SUPPORTED_DTYPES, VarlenPrefixedWrapper

MAX_HEAD_DIM = 256
__all__ = ["FA3PrefixedPrefillWrapper", "MAX_HEAD_DIM", "SUPPORTED_DTYPES"]


class FA3PrefixedPrefillWrapper(VarlenPrefixedWrapper):
    """Prefixed ragged prefill through FA3 (Hopper)."""

    module = "flash_attn_interface"
    library = "FA3"
    kernel = "flash_attn_interface.flash_attn_varlen_func"
    head_dim_multiple = 8
    max_head_dim = MAX_HEAD_DIM
    # A build without soft-cap (FLASHATTENTION_DISABLE_SOFTCAP, as tokenspeed-fa3 3.0.0 is) raises
    # its own error for softcap != 0; the plugin declares soft_cap only where the build has it.
    softcap_kwarg = "softcap"
    sinks_kwarg = "sinks"
    sinks_dtype = torch.bfloat16  # hopper's flash_api checks "sinks must have dtype bfloat16"
