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


# -- paged KV: flash_attn_with_kvcache and its scheduler metadata ----------------------------------
#
# flash_attn_interface.py of the same build: ``flash_attn_with_kvcache`` takes ``k_cache``/``v_cache``
# ``[num_blocks, page_block_size, nheads_k, headdim]`` (any strides but a unit last one: strided
# views of one tensor are read as they are), ``page_table [batch, max_blocks]`` int32,
# ``cache_seqlens [batch]`` int32 (keys per row), q ``[batch, seqlen, nheads, headdim]`` or, with
# ``cu_seqlens_q``/``max_seqlen_q``, packed ``[total_q, nheads, headdim]``. Masks are bottom-right
# aligned; a query that sees no key gets zeros. ``get_scheduler_metadata`` precomputes the tile
# schedule for one set of arguments: the stand-in records those arguments (and the seqlens) in the
# tensor it returns and the call refuses metadata made for anything else, as a stale schedule
# would be wrong on the GPU.

SCHEDULER_CALLS = 0
_META_FIELDS = 10


def _meta_key(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, page_size, causal,
              window_size, num_splits):
    return [int(batch_size), int(max_seqlen_q), int(max_seqlen_k), int(num_heads_q), int(num_heads_kv),
            int(headdim), int(page_size or 0), int(bool(causal)), int(window_size[0]) * 4099 + int(window_size[1]),
            int(num_splits)]


def get_scheduler_metadata(
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
    cache_seqlens,
    qkv_dtype=torch.bfloat16,
    headdim_v=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    cache_leftpad=None,
    page_size=None,
    max_seqlen_k_new=0,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    has_softcap=False,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):
    global SCHEDULER_CALLS
    SCHEDULER_CALLS += 1
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch_size,):
        raise RuntimeError("get_scheduler_metadata: cache_seqlens must be int32 [batch_size]")
    key = _meta_key(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, page_size, causal,
                    window_size, num_splits)
    lens = cache_seqlens.tolist()
    q_lens = [] if cu_seqlens_q is None else (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    return torch.tensor(key + lens + q_lens, dtype=torch.int32, device=cache_seqlens.device)


def _check_metadata(meta, key, cache_seqlens, cu_seqlens_q):
    want = key + cache_seqlens.tolist() + ([] if cu_seqlens_q is None else
                                           (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist())
    if meta.dtype != torch.int32 or meta.tolist() != want:
        raise RuntimeError("flash_attn_with_kvcache (stand-in): scheduler_metadata was computed for other arguments "
                           f"or sequence lengths ({meta.tolist()[:_META_FIELDS]} vs {key})")


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
    sinks=None,
):
    global CALLS
    CALLS += 1
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
    for name, val in (("k", k), ("v", v), ("qv", qv), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                      ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                      ("cu_seqlens_k_new", cu_seqlens_k_new), ("q_descale", q_descale), ("k_descale", k_descale),
                      ("v_descale", v_descale)):
        if val is not None:
            raise NotImplementedError(f"stand-in flash_attn_with_kvcache: {name} is not modelled")
    if page_table is None or cache_seqlens is None or isinstance(cache_seqlens, int):
        raise NotImplementedError("stand-in flash_attn_with_kvcache: only a paged cache with cache_seqlens "
                                  "[batch] is modelled")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_cache.dtype != q.dtype \
            or v_cache.dtype != q.dtype:
        raise RuntimeError("flash_attn_with_kvcache: q, k_cache and v_cache must have one dtype (fp16, bf16; "
                           f"fp8 all three), got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("cache_seqlens", cache_seqlens), ("page_table", page_table)):
        if t.dtype != torch.int32:
            raise RuntimeError(f"flash_attn_with_kvcache: {name} must have dtype int32")
        if t.device != q.device:
            raise RuntimeError(f"flash_attn_with_kvcache: {name} must be on the device of q")
    if page_table.stride(-1) != 1:
        raise RuntimeError("flash_attn_with_kvcache: page_table must have contiguous last dimension")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise RuntimeError("flash_attn_with_kvcache: k_cache and v_cache must be on the device of q")
    batch, max_blocks = page_table.shape
    page = k_cache.shape[1]
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise RuntimeError("flash_attn_with_kvcache: Number of heads in key/value must divide number of heads in query")
    if d > 256:
        raise RuntimeError("flash_attn_with_kvcache: FlashAttention forward only supports head dimension at most 256")
    if cache_seqlens.shape != (batch,):
        raise RuntimeError(f"flash_attn_with_kvcache: cache_seqlens must have shape [{batch}]")
    if cu_seqlens_q is None:
        if q.dim() != 4 or q.shape[0] != batch:
            raise RuntimeError(f"flash_attn_with_kvcache: q must be [batch={batch}, seqlen, heads, dim], got "
                               f"{tuple(q.shape)}")
        seqlen_q = q.shape[1]
        q_packed = q.reshape(batch * seqlen_q, hq, d)
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32)
        key_q = seqlen_q
    else:
        if q.dim() != 3 or max_seqlen_q is None:
            raise RuntimeError("flash_attn_with_kvcache: with cu_seqlens_q, q must be [total_q, heads, dim] and "
                               "max_seqlen_q given")
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (batch + 1,) or cu_seqlens_q.device != q.device:
            raise RuntimeError(f"flash_attn_with_kvcache: cu_seqlens_q must be int32 [{batch + 1}] on q's device")
        q_packed = q
        cu_q = cu_seqlens_q.cpu()
        if int((cu_q[1:] - cu_q[:-1]).max()) > max_seqlen_q or int(cu_q[-1]) > q.shape[0]:
            raise RuntimeError("flash_attn_with_kvcache: a row is longer than max_seqlen_q, or cu_seqlens_q "
                               "passes q's rows")
        key_q = max_seqlen_q
    if sinks is not None:
        _check_sinks(sinks, q_packed)
    if softcap != 0.0 and not SOFTCAP_BUILD:
        raise RuntimeError("This flash attention build does not support tanh softcapping.")
    if scheduler_metadata is not None:
        key = _meta_key(batch, key_q, max_blocks * page, hq, hkv, d, page, causal, tuple(window_size), num_splits)
        _check_metadata(scheduler_metadata, key, cache_seqlens, cu_seqlens_q)
    lens = cache_seqlens.tolist()
    if any(n < 0 or n > max_blocks * page for n in lens):
        raise RuntimeError("flash_attn_with_kvcache: a cache_seqlens entry is negative or past the page table")
    table = page_table.cpu()
    ks, vs, cu_k = [], [], [0]
    for b, n in enumerate(lens):
        pages = table[b, : -(-n // page)].long().to(k_cache.device)
        ks.append(k_cache.index_select(0, pages).reshape(-1, hkv, d)[:n])
        vs.append(v_cache.index_select(0, pages).reshape(-1, hkv, v_cache.shape[-1])[:n])
        cu_k.append(cu_k[-1] + n)
    kk, vv = torch.cat(ks), torch.cat(vs)
    tq = int(cu_q[-1])
    out, lse = _math.varlen_attention(q_packed[:tq], kk, vv, cu_q, torch.tensor(cu_k, dtype=torch.int32),
                                      softmax_scale, causal, tuple(window_size), softcap=float(softcap), sinks=sinks)
    full = torch.zeros(q_packed.shape[0], hq, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    full[:tq] = out
    full = full.reshape(q.shape[:-1] + (v_cache.shape[-1],))
    return (full, lse) if return_softmax_lse else full
