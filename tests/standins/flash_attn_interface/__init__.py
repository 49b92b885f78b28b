"""Stand-in for FlashAttention-3's ``flash_attn_interface`` (CPU tests only; injected by a
fixture, never installed). ``flash_attn_varlen_func`` has the real signature of the
tokenspeed-fa3 3.0.0 build and its checks (fp16/bf16, int32 cu_seqlens on q's device).

``RETURN_LSE_ALWAYS``: set True to mimic FA3 builds whose varlen function returns
``(out, softmax_lse)`` even without ``return_attn_probs``. ``CALLS`` counts calls.
"""

import importlib.util
import pathlib

import torch

_spec = importlib.util.spec_from_file_location(
    "_mstar_standin_varlen_math", pathlib.Path(__file__).resolve().parent.parent / "_varlen_math.py")
_math = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_math)

RETURN_LSE_ALWAYS = False
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
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    sinks=None,
):
    global CALLS
    CALLS += 1
    for name, val in (("seqused_q", seqused_q), ("seqused_k", seqused_k), ("qv", qv), ("sinks", sinks)):
        if val is not None:
            raise NotImplementedError(f"stand-in flash_attn_varlen_func: {name} is not modelled")
    if softcap or attention_chunk:
        raise NotImplementedError("stand-in flash_attn_varlen_func: softcap/attention_chunk are not modelled")
    _math.check_common("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k,
                       (torch.float16, torch.bfloat16, torch.float8_e4m3fn))
    if q.shape[-1] > 256:
        raise RuntimeError("flash_attn_varlen_func: FlashAttention forward only supports head dimension at most 256")
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item() if len(cu_seqlens_q) > 1 else 0
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item() if len(cu_seqlens_k) > 1 else 0
    if lens_q > max_seqlen_q or lens_k > max_seqlen_k:
        raise RuntimeError("flash_attn_varlen_func: a segment is longer than max_seqlen_q/max_seqlen_k")
    out, lse = _math.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, tuple(window_size))
    return (out, lse) if (return_attn_probs or RETURN_LSE_ALWAYS) else out
