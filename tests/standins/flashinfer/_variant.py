"""The JIT variant path of the stand-in's paged prefill (``jit_args``): only FlashInfer's
AttentionSink variant, as ``BatchAttentionWithAttentionSinkWrapper`` builds it (0.5.3
attention.py:241-275, prefill.py:1407-1415): the dtypes, head dims and sliding-window switch are
compiled into the module; ``run(q, cache, sink, sm_scale)`` passes the variant's extra tensor
(``float``: float32 ``[num_qo_heads]``) and scalar (``double``) positionally (prefill.py:2173-2174).

Where the real library would compute something else without a word, the stand-in raises:
a module name given twice for different compiled parameters (the real JIT cache keys the module
folder and library by the name alone, so the second wrapper would run the first's kernel), a
plan whose dtypes, head dim or window switch differ from the compiled ones, a soft-cap (the
variant has none), and run scales or ``sinks=`` the jit path drops (prefill.py:2061-2068, 2173)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .jit.attention.variants import attention_sink_decl

# Module name -> the compiled parameters first built under it, in this process.
BUILT: dict[str, tuple[Any, ...]] = {}


@dataclass(frozen=True)
class Variant:
    uri: str
    dtype_q: torch.dtype
    dtype_kv: torch.dtype
    head_dim_qk: int
    head_dim_vo: int
    use_sliding_window: bool


def load(backend: str, jit_args: list[Any], jit_kwargs: dict[str, Any] | None) -> Variant:
    """``get_customize_batch_prefill_module(backend, *jit_args, **jit_kwargs)``, for AttentionSink."""
    kw = dict(jit_kwargs or {})
    (uri, dtype_q, dtype_kv, dtype_o, idtype, d_qk, d_vo, tensor_names, tensor_dtypes, scalar_names,
     scalar_dtypes, variant_name, decl) = jit_args
    if backend not in attention_sink_decl:
        raise NotImplementedError(f"the flashinfer stand-in models jit variants on fa2/fa3, not {backend!r}")
    if (variant_name, list(tensor_names), list(tensor_dtypes), list(scalar_names), list(scalar_dtypes)) != (
            "AttentionSink", ["sink"], ["float"], ["sm_scale"], ["double"]) or decl is not attention_sink_decl[backend]:
        raise NotImplementedError("the flashinfer stand-in models one jit variant: AttentionSink, as "
                                  "BatchAttentionWithAttentionSinkWrapper declares it for this backend")
    if dtype_o != dtype_q or idtype != torch.int32:
        raise NotImplementedError("the flashinfer stand-in models dtype_o == dtype_q and int32 indices")
    if kw.pop("pos_encoding_mode", 0) or kw.pop("use_fp16_qk_reduction", False) or kw.pop("use_logits_soft_cap", False):
        raise NotImplementedError("the flashinfer stand-in models no RoPE, fp16 QK reduction or soft-cap variant")
    swa = bool(kw.pop("use_sliding_window", False))
    if kw:
        raise NotImplementedError(f"the flashinfer stand-in does not model jit_kwargs {sorted(kw)}")
    compiled = (backend, dtype_q, dtype_kv, d_qk, d_vo, swa)
    first = BUILT.setdefault(uri, compiled)
    if first != compiled:
        raise AssertionError(
            f"JIT module {uri!r} already built in this process for (backend, dtype_q, dtype_kv, head_dim_qk, "
            f"head_dim_vo, use_sliding_window) = {first}; the real library would load that module again for "
            f"{compiled} (its name does not tell them apart)")
    _build(uri)
    return Variant(uri, dtype_q, dtype_kv, int(d_qk), int(d_vo), swa)


def _build(uri: str) -> None:
    from .jit import env

    so = env.FLASHINFER_JIT_DIR / uri / f"{uri}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        so.write_bytes(b"")


def check_plan(v: Variant, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim_qk: int, head_dim_vo: int,
               window_left: int, soft_cap_on: bool) -> None:
    """A plan on the variant's module: the real plan takes the compiled module whatever it is given."""
    if (q_dtype, kv_dtype, head_dim_qk, head_dim_vo) != (v.dtype_q, v.dtype_kv, v.head_dim_qk, v.head_dim_vo):
        raise AssertionError(
            f"plan for (q, kv, head_dim_qk, head_dim_vo) = {(q_dtype, kv_dtype, head_dim_qk, head_dim_vo)} on the "
            f"module {v.uri!r} compiled for {(v.dtype_q, v.dtype_kv, v.head_dim_qk, v.head_dim_vo)}")
    if (window_left >= 0) != v.use_sliding_window:
        raise AssertionError(f"plan with window_left={window_left} on the module {v.uri!r} compiled with "
                             f"use_sliding_window={v.use_sliding_window}: the real kernel would not apply it")
    if soft_cap_on:
        raise NotImplementedError("logits_soft_cap given, but the AttentionSink variant applies no soft-cap: "
                                  "the real output would silently lack it")


def run_args(v: Variant, args: tuple[Any, ...], num_qo_heads: int, device: torch.device,
             q_scale: float | None, k_scale: float | None, sinks: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """The variant's ``(sink, sm_scale)`` from ``run``'s positional arguments, checked as the kernel
    reads them (a float32 array indexed by query head; a double)."""
    if sinks is not None:
        raise NotImplementedError("run(sinks=) on the jit path: the real library drops it (the variant takes "
                                  "the sink logits positionally)")
    if q_scale not in (None, 1.0) or k_scale not in (None, 1.0):
        raise NotImplementedError("q_scale/k_scale on the jit path: the real library folds them into an sm_scale "
                                  "it does not pass (the variant's own sm_scale argument is used)")
    if len(args) != 2:
        raise TypeError(f"the AttentionSink module takes (sink, sm_scale) after paged_kv_cache, got {len(args)} "
                        "arguments")
    sink, sm_scale = args
    if not (torch.is_tensor(sink) and sink.dtype == torch.float32 and sink.is_contiguous()
            and tuple(sink.shape) == (num_qo_heads,) and sink.device == device):
        got = (f"{tuple(sink.shape)} {sink.dtype} on {sink.device}, contiguous={sink.is_contiguous()}"
               if torch.is_tensor(sink) else type(sink).__name__)
        raise ValueError(f"sink must be a contiguous float32 tensor [{num_qo_heads}] on {device}, got {got}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float, got {type(sm_scale).__name__}")
    return sink, float(sm_scale)
