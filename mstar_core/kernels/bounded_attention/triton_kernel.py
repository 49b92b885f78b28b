"""Bounded attention in Triton (GPU).

One program per (query block, request row, KV head). It walks the keys in four segments —
source prefix, row-source prefix, retained cache (sink + ring), the step's own keys — with an
online softmax in fp32, so no score matrix ever reaches global memory, and for decode (one query
block per row) each retained key is read exactly once. The query heads sharing a KV head are
packed into the query block (query ``m`` is token ``m // G``, head ``kv_head * G + m % G``).

Compiles: the prefix sources are runtime flags, and the integers that change from step to step
without touching the hot loop (strides of the per-step tensors, prefix lengths) are not
specialised on, so a long run with and without sources compiles each variant once. The integers
the key loop computes with (T, SINK, WINDOW, QW, the cache strides) keep Triton's specialisation:
dropping it measured 5-9% slower decode at 128-256 rows on an H200.

This module imports triton at import time; the package imports it only when the Triton path is
taken, so a machine without triton still imports the package. Absolute imports only: the tests
load a second copy of this file under the Triton interpreter.
"""

from __future__ import annotations

import inspect
import math

import torch
import triton
import triton.language as tl

from mstar_core.kernels.bounded_attention import table as tb

LOG2E = 1.4426950408889634

# Runtime integers that vary per step but stay out of the key loop's arithmetic.
_NOT_SPECIALISED = ["stride_qr", "stride_qh", "stride_qt", "stride_kr", "stride_kh", "stride_kt", "stride_vr",
                    "stride_vh", "stride_vt", "stride_ss", "stride_sr", "stride_sh", "stride_sn", "stride_rs",
                    "stride_rr", "stride_rh", "stride_rn", "stride_br", "stride_bh", "stride_bt", "stride_or",
                    "stride_ot", "stride_oh", "SRC_L", "ROW_L", "NB", "HAS_SRC", "HAS_ROW"]


def _jit_options(names: list[str]) -> dict:
    opts = inspect.signature(triton.jit).parameters
    return {k: names for k in ("do_not_specialize", "do_not_specialize_on_alignment") if k in opts}


def decode_tiles(head_dim: int, element_size: int) -> tuple[int, int, int | None]:
    """(block_n, num_warps, num_stages) of the one-query-block (decode) launch: 128 keys a step in
    two stages where a tile of K and V fits shared memory twice over (16-bit, head dim <= 128),
    Triton's defaults with 64 keys otherwise (the faster of the two on an H200 at each size)."""
    if element_size <= 2 and head_dim <= 128:
        return 128, 4, 2
    return 64, 4, None


@triton.jit
def _online_update(acc, m_i, l_i, s, vt, IEEE: tl.constexpr):
    # s: [BM, BN] scores in the log2 domain, -inf where not visible.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _scores(q, kt, qk_scale, IEEE: tl.constexpr):
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return s * qk_scale


@triton.jit
def _prefix_segment(acc, m_i, l_i, q, base, stride_n, n_keys, m_valid, offs_d, d_mask, qk_scale,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # Prefix keys carry no stream position: visible to every real query, no rel_bias.
    for n0 in range(0, n_keys, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_keys
        ptr = base + offs_n[:, None] * stride_n + offs_d[None, :]
        ld = n_ok[:, None] & d_mask[None, :]
        kb = tl.load(ptr, mask=ld, other=0.0).to(q.dtype)
        vb = tl.load(ptr + D, mask=ld, other=0.0).to(q.dtype)
        s = _scores(q, tl.trans(kb), qk_scale, IEEE)
        s = tl.where(m_valid[:, None] & n_ok[None, :], s, float("-inf"))
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, vb, IEEE)
    return acc, m_i, l_i


@triton.jit(**_jit_options(_NOT_SPECIALISED))
def _bounded_fwd(
    Q, K, V, Cache, Table, Src, RowSrc, RowSlots, Bias, Out,
    stride_qr, stride_qh, stride_qt,
    stride_kr, stride_kh, stride_kt,
    stride_vr, stride_vh, stride_vt,
    stride_cs, stride_cr, stride_ch, stride_cn,
    stride_ss, stride_sr, stride_sh, stride_sn,
    stride_rs, stride_rr, stride_rh, stride_rn,
    stride_br, stride_bh, stride_bt,
    stride_or, stride_ot, stride_oh,
    T, ROWS, H, SRC_L, ROW_L, NB, qk_scale, SINK, WINDOW, QW, HAS_SRC, HAS_ROW,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NCOL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_QW: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    hkv = pid_bh % H
    br = pid_bh // H
    b = br // ROWS
    r = br % ROWS
    row = Table + b * NCOL
    slot = tl.load(row + 0).to(tl.int64)
    start = tl.load(row + 1)
    ntok = tl.load(row + 2)
    sink_kept = tl.load(row + 3)
    ring_kept = tl.load(row + 4)
    src = tl.load(row + 5)
    src_len = tl.load(row + 6)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // G
    hq = hkv * G + offs_m % G
    m_valid = t < ntok
    qpos = start + t
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    br64 = br.to(tl.int64)

    q_ptr = Q + br64 * stride_qr + hq[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptr, mask=m_valid[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # runtime flags, not constexpr: a step with or without a prefix source runs the same kernel
    if HAS_SRC != 0:
        if src >= 0:
            n_keys = tl.where(src_len < 0, SRC_L, src_len)
            base = Src + src.to(tl.int64) * stride_ss + r * stride_sr + hkv * stride_sh
            acc, m_i, l_i = _prefix_segment(acc, m_i, l_i, q, base, stride_sn, n_keys, m_valid,
                                            offs_d, d_mask, qk_scale, D, BLOCK_N, IEEE)
    if HAS_ROW != 0:
        if src == -1:
            rslot = tl.load(RowSlots + b).to(tl.int64)
            n_keys = tl.where(src_len < 0, ROW_L, src_len)
            base = RowSrc + rslot * stride_rs + r * stride_rr + hkv * stride_rh
            acc, m_i, l_i = _prefix_segment(acc, m_i, l_i, q, base, stride_rn, n_keys, m_valid,
                                            offs_d, d_mask, qk_scale, D, BLOCK_N, IEEE)

    bias_row = Bias + br64 * stride_br + hq[:, None] * stride_bh + t[:, None] * stride_bt

    # Retained keys: cache indices [0, sink_kept) and [SINK, SINK + ring_kept).
    c_base = Cache + slot * stride_cs + r * stride_cr + hkv * stride_ch
    c_hi = tl.where(ring_kept > 0, SINK + ring_kept, sink_kept)
    for n0 in range(0, c_hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        kvalid = (j < sink_kept) | ((j >= SINK) & (j < SINK + ring_kept))
        back = (start - 1 - j) % WINDOW  # >= 0 wherever kvalid
        kpos = tl.where(j < SINK, j, start - 1 - back)
        ptr = c_base + j[:, None] * stride_cn + offs_d[None, :]
        ld = kvalid[:, None] & d_mask[None, :]
        kb = tl.load(ptr, mask=ld, other=0.0).to(q.dtype)
        vb = tl.load(ptr + D, mask=ld, other=0.0).to(q.dtype)
        s = _scores(q, tl.trans(kb), qk_scale, IEEE)
        vis = m_valid[:, None] & kvalid[None, :]
        if HAS_QW:
            dist = qpos[:, None] - kpos[None, :]
            vis = vis & ((kpos[None, :] < SINK) | (dist <= QW))
        if HAS_BIAS:
            dist = tl.minimum(tl.maximum(qpos[:, None] - kpos[None, :], 0), NB - 1)
            s += tl.load(bias_row + dist, mask=vis, other=0.0).to(tl.float32) * 1.4426950408889634
        s = tl.where(vis, s, float("-inf"))
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, vb, IEEE)

    # The step's own keys, causal: the block's last token bounds the keys it can see.
    last_t = (pid_m * BLOCK_M + BLOCK_M - 1) // G
    own_hi = tl.minimum(ntok, last_t + 1)
    k_base = K + br64 * stride_kr + hkv * stride_kh
    v_base = V + br64 * stride_vr + hkv * stride_vh
    for n0 in range(0, own_hi, BLOCK_N):
        tk = n0 + tl.arange(0, BLOCK_N)
        kvalid = tk < ntok
        ld = kvalid[:, None] & d_mask[None, :]
        kb = tl.load(k_base + tk[:, None] * stride_kt + offs_d[None, :], mask=ld, other=0.0).to(q.dtype)
        vb = tl.load(v_base + tk[:, None] * stride_vt + offs_d[None, :], mask=ld, other=0.0).to(q.dtype)
        s = _scores(q, tl.trans(kb), qk_scale, IEEE)
        kpos = start + tk
        vis = m_valid[:, None] & kvalid[None, :] & (tk[None, :] <= t[:, None])
        if HAS_QW:
            dist = qpos[:, None] - kpos[None, :]
            vis = vis & ((kpos[None, :] < SINK) | (dist <= QW))
        if HAS_BIAS:
            dist = tl.minimum(tl.maximum(qpos[:, None] - kpos[None, :], 0), NB - 1)
            s += tl.load(bias_row + dist, mask=vis, other=0.0).to(tl.float32) * 1.4426950408889634
        s = tl.where(vis, s, float("-inf"))
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, vb, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding queries saw nothing: 0
    o_ptr = Out + br64 * stride_or + t[:, None] * stride_ot + hq[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=(t < T)[:, None] & d_mask[None, :])


@triton.jit(**_jit_options(["stride_kr", "stride_kh", "stride_kt", "stride_vr", "stride_vh", "stride_vt"]))
def _write_step(
    K, V, Cache, Table,
    stride_kr, stride_kh, stride_kt,
    stride_vr, stride_vh, stride_vt,
    stride_cs, stride_cr, stride_ch, stride_cn,
    T, ROWS, H, SINK, WINDOW,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, NCOL: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % H
    br = pid_bh // H
    b = br // ROWS
    r = br % ROWS
    row = Table + b * NCOL
    slot = tl.load(row + 0).to(tl.int64)
    start = tl.load(row + 1)
    ntok = tl.load(row + 2)
    write = tl.load(row + 7)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    pos = start + t
    # Sink positions, and only the last WINDOW ring positions: destinations stay unique.
    n_write = tl.where(write != 0, ntok, 0)
    keep = (t < n_write) & ((pos < SINK) | (pos >= start + ntok - WINDOW))
    dest = tl.where(pos < SINK, pos, SINK + (pos - SINK) % WINDOW)
    offs_d = tl.arange(0, BLOCK_D)
    ld = keep[:, None] & (offs_d < D)[None, :]
    br64 = br.to(tl.int64)
    kb = tl.load(K + br64 * stride_kr + h * stride_kh + t[:, None] * stride_kt + offs_d[None, :], mask=ld)
    vb = tl.load(V + br64 * stride_vr + h * stride_vh + t[:, None] * stride_vt + offs_d[None, :], mask=ld)
    c_ptr = Cache + slot * stride_cs + r * stride_cr + h * stride_ch + dest[:, None] * stride_cn + offs_d[None, :]
    tl.store(c_ptr, kb.to(Cache.dtype.element_ty), mask=ld)
    tl.store(c_ptr + D, vb.to(Cache.dtype.element_ty), mask=ld)


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def bounded_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    *,
    sink: int,
    window: int,
    query_window: int | None = None,
    source: torch.Tensor | None = None,
    row_source: tuple[torch.Tensor, torch.Tensor] | None = None,
    rel_bias: torch.Tensor | None = None,
    sm_scale: float | None = None,
    ieee: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """See :func:`mstar_core.kernels.bounded_attention.bounded_attention`. ``block_m``,
    ``block_n``, ``num_warps``, ``num_stages``: launch tuning (the benchmark sweeps them; None:
    :func:`decode_tiles` for a decode launch, 64 keys and 4 warps otherwise)."""
    q, k, v = (_inner_contiguous(x) for x in (q, k, v))
    B = table.shape[0]
    BR, Hq, T, D = q.shape
    rows = BR // B
    H = k.shape[1]
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.empty(BR, T, Hq, D, dtype=q.dtype, device=q.device)
    table = table.to(q.device, torch.int32)
    # Decode packs the G heads of one token; min 16 rows for tl.dot.
    bm = block_m or (16 if T * G <= 16 else 64)
    if bm == 16 and T * G <= 16:
        tiles = decode_tiles(D, cache.element_size())
    else:
        tiles = (64, 4, None)
    block_n = tiles[0] if block_n is None else block_n
    num_warps = tiles[1] if num_warps is None else num_warps
    num_stages = tiles[2] if num_stages is None else num_stages
    block_d = max(16, triton.next_power_of_2(D))
    src = _inner_contiguous(source) if source is not None else cache
    if row_source is not None:
        rstore, rslots = _inner_contiguous(row_source[0]), row_source[1].to(q.device, torch.int32)
    else:
        rstore, rslots = cache, table
    bias = rel_bias if rel_bias is not None else q
    nb = rel_bias.shape[-1] if rel_bias is not None else 1
    if rel_bias is not None:
        bias = _inner_contiguous(rel_bias)
    grid = (triton.cdiv(T * G, bm), BR * H)
    _bounded_fwd[grid](
        q, k, v, cache, table, src, rstore, rslots, bias, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        src.stride(0), src.stride(1), src.stride(2), src.stride(3),
        rstore.stride(0), rstore.stride(1), rstore.stride(2), rstore.stride(3),
        bias.stride(0), bias.stride(1), bias.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        T, rows, H, src.shape[3], rstore.shape[3], nb, scale * LOG2E, sink, window,
        query_window if query_window is not None else 0, int(source is not None), int(row_source is not None),
        G=G, D=D, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=block_n, NCOL=tb.NUM_COLS,
        HAS_BIAS=rel_bias is not None, HAS_QW=query_window is not None, IEEE=ieee,
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out


def write_step_triton(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, *, sink: int, window: int
) -> None:
    """Same contract as ``write_step_reference``; no host synchronisation (capturable)."""
    k, v = _inner_contiguous(k), _inner_contiguous(v)
    B = table.shape[0]
    BR, H, T, D = k.shape
    table = table.to(k.device, torch.int32)
    block_t = 32
    grid = (triton.cdiv(T, block_t), BR * H)
    _write_step[grid](
        k, v, cache, table,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        T, BR // B, H, sink, window,
        D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_T=block_t, NCOL=tb.NUM_COLS,
        num_warps=4,
    )
