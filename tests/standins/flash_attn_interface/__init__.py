"""Stand-in for FlashAttention-3's ``flash_attn_interface`` (CPU tests only; injected by a
fixture, never installed). ``flash_attn_varlen_func`` has the real signature of the
tokenspeed-fa3 3.0.0 build (flash_attn_interface.py ``flash_attn_varlen_func``, same argument
order and keywords) and its checks (fp16/bf16/fp8_e4m3, int32 cu_seqlens on q's device).

Features, as that build does them (its ``flash_attn_3/_C.abi3.so`` is the source of the
build-specific facts below; the math is upstream hopper/'s):

- ``window_size=(left, right)``: bottom-right aligned, -1 unbounded; ``causal`` caps right at 0.
- ``softcap``: this build is compiled with ``FLASHATTENTION_DISABLE_SOFTCAP`` (every
  ``run_mha_fwd_`` instantiation in the .so has ``Has_softcap=false``, and the .so holds the
  check's message), so any ``softcap != 0.0`` raises ``RuntimeError("This flash attention build
  does not support tanh softcapping.")``. ``SOFTCAP_BUILD = True`` makes the stand-in a build
  with soft-cap instead (upstream's default): ``softcap > 0`` turns each scaled score ``s`` into
  ``softcap * tanh(s / softcap)``; ``softcap <= 0`` is off.
- ``sinks``: a logit per query head added to each softmax denominator (the probabilities are
  ``softmax([scores..., sinks[h]])`` with the sink column dropped; the returned lse includes
  it). The build's checks, in its order and words: dtype bfloat16 ("sinks must have dtype
  bfloat16"), on q's device (the build: CUDA), shape ``[num_heads_q]`` (its CHECK_SHAPE
  messages), contiguous.
- ``q_descale``/``k_descale``/``v_descale`` (FP8): not modelled, refused. FP8 (e4m3) inputs
  give a bfloat16 output, as the build's ``mha_fwd`` does.

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
SOFTCAP_BUILD = False  # tokenspeed-fa3 3.0.0 is built without soft-cap (see the module docstring)
CALLS = 0
STANDIN = True


def _check_sinks(sinks, q):
    """The build's checks on ``sinks`` (CHECK_SHAPE's per-dimension messages of hopper's
    flash_api_stable.cpp)."""
    if sinks.dtype != torch.bfloat16:
        raise RuntimeError("sinks must have dtype bfloat16")
    if sinks.device != q.device:
        raise RuntimeError(f"sinks must be on the device of q ({q.device}); the real build: sinks must be on CUDA")
    if sinks.dim() != 1:
        raise RuntimeError(f"sinks must have 1 dimensions, got {sinks.dim()}")
    if sinks.size(0) != q.shape[1]:
        raise RuntimeError(f"sinks dimension 0 must have size {q.shape[1]}, got {sinks.size(0)}")
    if not sinks.is_contiguous():
        raise RuntimeError("sinks must be contiguous")


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
    for name, val in (("seqused_q", seqused_q), ("seqused_k", seqused_k), ("qv", qv), ("q_descale", q_descale),
                      ("k_descale", k_descale), ("v_descale", v_descale)):
        if val is not None:
            raise NotImplementedError(f"stand-in flash_attn_varlen_func: {name} is not modelled")
    if attention_chunk:
        raise NotImplementedError("stand-in flash_attn_varlen_func: attention_chunk is not modelled")
    _math.check_common("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k,
                       (torch.float16, torch.bfloat16, torch.float8_e4m3fn))
    if q.shape[-1] > 256:
        raise RuntimeError("flash_attn_varlen_func: FlashAttention forward only supports head dimension at most 256")
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item() if len(cu_seqlens_q) > 1 else 0
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item() if len(cu_seqlens_k) > 1 else 0
    if lens_q > max_seqlen_q or lens_k > max_seqlen_k:
        raise RuntimeError("flash_attn_varlen_func: a segment is longer than max_seqlen_q/max_seqlen_k")
    if sinks is not None:
        _check_sinks(sinks, q)
    if softcap != 0.0 and not SOFTCAP_BUILD:
        raise RuntimeError("This flash attention build does not support tanh softcapping.")
    out, lse = _math.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, tuple(window_size),
                                      softcap=float(softcap), sinks=sinks,
                                      # mha_fwd: an FP8 input gives a bfloat16 output
                                      out_dtype=torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
    return (out, lse) if (return_attn_probs or RETURN_LSE_ALWAYS) else out
