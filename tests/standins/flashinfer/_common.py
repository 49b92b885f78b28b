"""Helpers shared by the stand-in wrappers, mirroring flashinfer.utils."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mstar_core.backends.reference.math import (
    attend_padded,
    build_padding,
    gather_paged_slots,
    gather_ragged_slots,
)

from .page import get_seq_lens

_UNSUPPORTED = "the flashinfer stand-in does not model {}"


class Profile:
    """Which release's behaviour the stand-in shows (``flashinfer.emulate``). 0.5.3 is the base:
    its signatures are the stand-in's own. From 0.7 the paged and ragged prefill ``run`` refuse a
    q whose rows differ from the plan's ``qo_indptr[-1]`` (kept in ``_qo_indptr_last``) and an
    output the paged prefill allocates is zero-filled; from 0.7.4 the paged prefill takes
    ``max_total_num_rows`` at construction and chooses fa2/fa3 per plan (a graph-mode wrapper:
    at its first plan, for good)."""

    version = "0.5.3"
    q_rows_check = False


PROFILE = Profile()

# jit/utils.py filename_safe_dtype_map (f32 is the stand-in's own: the real map has none)
_TAG = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float8_e4m3fn: "e4m3",
        torch.float8_e5m2: "e5m2"}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_float8(x: torch.Tensor) -> bool:
    """utils.py:158."""
    return x.dtype in _FP8


def soft_cap_on(logits_soft_cap: float | None) -> bool:
    """0.5.3 turns soft-cap on with ``logits_soft_cap > 0`` (None is 0.0: decode.py:918-919,
    prefill.py:1682 and 2634): the module is built ``use_logits_soft_cap=logits_soft_cap > 0``
    (decode.py:1041/1079, prefill.py:1834/2731), so 0, None and negative caps are off."""
    return logits_soft_cap is not None and logits_soft_cap > 0


def run_sm_scale(sm_scale: float | None, head_dim: int, q_scale: float | None,
                 k_scale: float | None) -> float:
    """The scale the kernel gets (decode.py:1257-1265, prefill.py:2061-2068): the plan's
    ``sm_scale`` (default ``1/sqrt(head_dim)``) times ``q_scale`` and ``k_scale``. So scores are
    ``q . k_stored * sm_scale * q_scale * k_scale``, soft-capped after that."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if q_scale is not None:
        sm_scale *= q_scale
    if k_scale is not None:
        sm_scale *= k_scale
    return sm_scale


def apply_v_scale(out: torch.Tensor, v_scale: float | None) -> torch.Tensor:
    """After the kernel (decode.py:1376-1381, prefill.py:2207-2212): ``out`` (in q's dtype, the
    caller's buffer when given) scaled in place, or a new tensor for an FP8 output."""
    if v_scale is not None:
        if is_float8(out):
            out = (out.to(torch.float32) * v_scale).to(out.dtype)
        else:
            out *= v_scale
    return out


def refuse_sinks(sinks: torch.Tensor | None, backend: str, where: str) -> None:
    """0.5.3's ``run(..., sinks=)`` reaches the sinks only on the trtllm-gen backend (sm100):
    the paged prefill passes them to ``paged_run`` (prefill.py:2202), whose fa2 and fa3
    branches drop them (prefill.py:514-671; only the trtllm-gen branch uses them, 589); the
    tensor-core decode passes them positionally into ``paged_run``'s ``batch_size`` slot, unused
    by fa2 (decode.py:1319-1335); the CUDA-core decode does not pass them at all
    (decode.py:1342-1372). No error, no effect. The stand-in refuses them instead, so that a
    wrapper relying on them fails here rather than computing without them on a GPU."""
    if sinks is None:
        return
    if backend == "trtllm-gen":
        raise NotImplementedError(f"{where}: the flashinfer stand-in does not model the trtllm-gen backend (sinks)")
    raise NotImplementedError(
        f"{where}: sinks given, but the real FlashInfer 0.5.3 ignores sinks on this backend "
        f"({backend}; only trtllm-gen, on sm100, applies them): the output would silently lack them")


def build_module(kind: str, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, window_left: int,
                 soft_cap: float | None, backend: str = "fa2") -> str:
    """The module a plan needs, named as FlashInfer names it (jit/attention/modules.py), "built"
    into the JIT folder the first time: an empty file, as no compiler runs here."""
    from .jit import env

    if kind == "prefill" and backend == "fa2" and q_dtype in _FP8:  # jit/attention/modules.py:975-978
        raise AssertionError("fp8 tensor core is not supported in fa2 backend")
    if q_dtype in _FP8:
        raise NotImplementedError(_UNSUPPORTED.format("FP8 queries"))
    q, kv = _TAG.get(q_dtype, str(q_dtype)), _TAG.get(kv_dtype, str(kv_dtype))
    name = (f"batch_{kind}_with_kv_cache_dtype_q_{q}_dtype_kv_{kv}_dtype_o_{q}_dtype_idx_i32_head_dim_qk_{head_dim}"
            f"_head_dim_vo_{head_dim}_posenc_0_use_swa_{window_left >= 0}_use_logits_cap_{soft_cap_on(soft_cap)}")
    if kind == "prefill":
        name += "_f16qk_False" + ("_sm90" if backend == "fa3" else "")
    so = env.FLASHINFER_JIT_DIR / name / f"{name}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        so.write_bytes(b"")
    return name


def check_q_rows(wrapper, q: torch.Tensor) -> None:
    """0.7's check in paged and ragged prefill ``run`` (prefill.py, same message)."""
    if PROFILE.q_rows_check and q.size(0) != wrapper._qo_indptr_last:
        raise ValueError(
            f"q.shape[0] ({q.size(0)}) does not match qo_indptr[-1] ({wrapper._qo_indptr_last}). "
            f"For paged prefill, q must have shape [total_tokens, num_heads, head_dim] "
            f"where total_tokens = qo_indptr[-1]."
        )


def new_out(shape, q: torch.Tensor) -> torch.Tensor:
    return (torch.zeros if PROFILE.q_rows_check else torch.empty)(shape, dtype=q.dtype, device=q.device)


def canonicalize_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(f"dtype must be a string or torch.dtype, got {type(dtype)}")


def check_kv_layout(kv_layout: str) -> None:
    if kv_layout not in ("NHD", "HND"):
        raise KeyError(f"Invalid kv_layout {kv_layout}")


def check_cached_qkv_data_type(q: torch.Tensor, k: torch.Tensor, dtype_q: torch.dtype, dtype_kv: torch.dtype) -> None:
    if q.dtype != dtype_q:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {dtype_q} specified in plan "
                         "function.")
    if k.dtype != dtype_kv:
        raise ValueError(f"The dtype of k {k.dtype} does not match the kv_data_type {dtype_kv} specified in plan "
                         "function.")


def check_shape_dtype_device(x: torch.Tensor, expected_shape: Sequence[int] | None, expected_dtype,
                             expected_device, name: str) -> None:
    if expected_shape and x.shape != torch.Size(expected_shape):
        raise ValueError(f"Invalid shape of {name}: expected {expected_shape}, got {x.shape}")
    if expected_dtype and x.dtype != expected_dtype:
        raise ValueError(f"Invalid dtype of {name}: expected {expected_dtype}, got {x.dtype}")
    if expected_device and x.device != expected_device:
        raise ValueError(f"Invalid device of {name}: expected {expected_device}, got {x.device}")


def unpack_paged_kv_cache(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(paged_kv_cache, tuple):
        return paged_kv_cache
    if torch.is_tensor(paged_kv_cache):
        k, v = paged_kv_cache.unbind(dim=1)
        return k, v
    raise KeyError(f"Unrecognized paged_kv_cache type {type(paged_kv_cache)}, expect a single tensor or a tuple of "
                   "tensor.")


def unsupported(**named) -> None:
    for name, value in named.items():
        if value not in (None, False, 0, 0.0, "NONE"):
            raise NotImplementedError(_UNSUPPORTED.format(name))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor, batch_size: int,
    causal: bool, window_left: int, sm_scale: float, kv_layout: str, out: torch.Tensor,
    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the paged kernels compute, read from the (device) buffers they would read. The
    cache is read in its stored dtype (FP8 too) and converted to float for the math; scores are
    ``q . k * sm_scale`` (the run's scale, k_scale folded in), then soft-capped when
    ``logits_soft_cap > 0`` (variants.cuh DefaultAttention: ``cap * tanh(s / cap)``). ``sinks``
    (the AttentionSink variant): ``exp(sinks[h])`` joins head h's softmax denominator."""
    qo = qo_indptr[: batch_size + 1].cpu().long()
    indptr = kv_indptr[: batch_size + 1].cpu().long()
    last = last_page_len[:batch_size].cpu().long()
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    page_size = k_cache.shape[1]
    kv_lens = get_seq_lens(indptr, last, page_size)
    pad = build_padding(qo[1:] - qo[:-1], kv_lens, causal, window_left, q.device, num_qo_heads=q.shape[1],
                        num_kv_heads=k_cache.shape[2], head_dim=q.shape[2])
    slots = gather_paged_slots(pad, indptr, kv_indices[: int(indptr[-1])], page_size)
    a, b = int(qo[0]), int(qo[-1])
    if b > a:
        out[a:b] = attend_padded(q[a:b], k_cache, v_cache, pad, sm_scale, slots, **_extras(logits_soft_cap, sinks))
    return out


def _extras(logits_soft_cap: float | None, sinks: torch.Tensor | None = None) -> dict:
    """The reference math's soft-cap and sinks, asked for only when on (the plain path keeps the
    original call)."""
    if not soft_cap_on(logits_soft_cap) and sinks is None:
        return {}
    from mstar_core.backends.reference.math import Extras

    cap = float(logits_soft_cap) if soft_cap_on(logits_soft_cap) else None
    return {"extras": Extras(soft_cap=cap, sinks=sinks)}


def ragged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
    causal: bool, window_left: int, sm_scale: float, out: torch.Tensor, logits_soft_cap: float | None = None,
) -> torch.Tensor:
    qo, kv = qo_indptr.cpu().long(), kv_indptr.cpu().long()
    k_lens = kv[1:] - kv[:-1]
    pad = build_padding(qo[1:] - qo[:-1], k_lens, causal, window_left, q.device, num_qo_heads=q.shape[1],
                        num_kv_heads=k.shape[1], head_dim=q.shape[2])
    slots = gather_ragged_slots(pad, kv)  # absolute indices into k/v
    a, b = int(qo[0]), int(qo[-1])
    if b > a:
        out[a:b] = attend_padded(q[a:b], k, v, pad, sm_scale, slots, **_extras(logits_soft_cap))
    return out
