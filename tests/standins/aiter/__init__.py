"""Stand-in for AMD's ``aiter`` (CPU tests only; injected by a fixture, never installed).
``flash_attn_varlen_func`` has the real signature (ROCm/aiter ``aiter/ops/mha.py``) and return
convention: ``out`` alone, or a tuple with ``softmax_lse`` / the probabilities when asked.
``CALLS`` counts calls."""

import importlib.util
import pathlib

import torch

_spec = importlib.util.spec_from_file_location(
    "_mstar_standin_varlen_math", pathlib.Path(__file__).resolve().parent.parent / "_varlen_math.py")
_math = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_math)

CALLS = 0
STANDIN = True


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    bias=None,
    alibi_slopes=None,
    deterministic=False,
    return_lse=False,
    return_attn_probs=False,
    block_table=None,
):
    global CALLS
    CALLS += 1
    if dropout_p:
        raise NotImplementedError("stand-in aiter.flash_attn_varlen_func: dropout is not modelled")
    for name, val in (("bias", bias), ("alibi_slopes", alibi_slopes), ("block_table", block_table)):
        if val is not None:
            raise NotImplementedError(f"stand-in aiter.flash_attn_varlen_func: {name} is not modelled")
    _math.check_common("aiter.flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k,
                       (torch.float16, torch.bfloat16))
    out, lse = _math.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, tuple(window_size))
    result = [out]
    if return_lse:
        result.append(lse)
    if return_attn_probs:
        result.append(torch.empty(0, dtype=q.dtype, device=q.device))  # S_dmask: only with dropout
    return result[0] if len(result) == 1 else tuple(result)
