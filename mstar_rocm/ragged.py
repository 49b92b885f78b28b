"""``AiterPrefixedPrefillWrapper``: the dense path's prefixed ragged prefill on ROCm over
AITER's ``aiter.flash_attn_varlen_func`` (CK flash attention; the shared logic is
``mstar_core.plugin.VarlenPrefixedWrapper``).

Signature used (ROCm/aiter, ``aiter/ops/mha.py``): ``flash_attn_varlen_func(q, k, v,
cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
causal=False, window_size=(-1, -1), bias=None, alibi_slopes=None, deterministic=False,
return_lse=False, return_attn_probs=False, block_table=None)``; it returns ``out`` alone unless
asked for more, a tuple otherwise — both are accepted. Its causal mask is aligned bottom-right.
Only keyword arguments every version has are passed.
"""

from __future__ import annotations

from mstar_core.plugin import SUPPORTED_DTYPES, VarlenPrefixedWrapper

MAX_HEAD_DIM = 256
__all__ = ["AiterPrefixedPrefillWrapper", "MAX_HEAD_DIM", "SUPPORTED_DTYPES"]


class AiterPrefixedPrefillWrapper(VarlenPrefixedWrapper):
    """Prefixed ragged prefill through AITER."""

    module = "aiter"
    library = "AITER"
    kernel = "aiter.flash_attn_varlen_func"
    max_head_dim = MAX_HEAD_DIM
    extra_kwargs = {"dropout_p": 0.0}
