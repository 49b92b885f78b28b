"""Attention over padded rows: the reference backend's one piece of arithmetic.

Rows are padded to the longest query and key length of their *row chunk*; masks remove the
padding, apply the causal mask aligned bottom-right (query i of a row with q_len queries and
kv_len keys sits at position ``kv_len - q_len + i``) and ``window_left``. No Python loop over
tokens: one vectorised pass per scores block.

Non-finite values (the rule every reference caller gets):

- a key slot ``j >= kv_len`` of a row (padding, a freed page, another row's page) never
  influences that row, whatever it holds;
- a query that sees no key returns zeros (whatever the query holds);
- a NaN/inf in a query, or in the K or V of a key that query sees (inside its causal/window
  mask), makes that query's output NaN for the heads reading it, never a silent 0;
- a non-finite key of the row that a query does not see (causal future, outside its window)
  does not affect that query. (Masked scores are filled with -inf, non-finite V is zeroed for
  the product, and the queries that see a non-finite K/V, or hold a non-finite value, are then
  set to NaN explicitly.)

On a CPU (no soft-cap, no sinks) each block is one ``scaled_dot_product_attention`` call: the
padding slots of the gathered K/V are zeroed, and one sum per chunk tells whether any input is
non-finite; only then are those values zeroed and the queries that see them set to NaN, so the
common case pays no per-element check and every other query's result is the same, bit for bit.
(Its softmax is accumulated unnormalised: V values within a factor of the row's key count of
the dtype's largest finite value may overflow there where the materialised path stays finite.)

Memory: :func:`build_padding` splits the rows into consecutive chunks and, where one row is
too long, its queries into blocks, so that one block's scores (``rows x Hq x queries x keys``)
plus its padded queries/outputs hold at most ``SCORES_BUDGET`` elements (each lives in a few
temporaries: scores, probabilities) and one chunk's gathered K/V at most ``SCORES_BUDGET``
elements too, unless one row's keys alone exceed it. So extra memory beyond the inputs is at
most about ``SCORES_BUDGET`` scores plus one row chunk's gathered K/V; a single query row over
max_k keys (all heads) is the floor. No ``[rows, max_q, max_k]`` mask is kept: each block's
mask is computed from per-row q_len/kv_len, causal and window when it runs. A batch that fits
the budget is one block, as fast as a single padded pass. Results are exact (a full softmax per
query), accumulated in float32 (float64 for float64 inputs) and returned in ``q``'s dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mstar_core.errors import InputError

# Elements one scores block (plus its padded queries/outputs) may hold, and one row chunk's
# gathered K/V. Read by build_padding at plan time; tests monkeypatch it.
SCORES_BUDGET = 1 << 24


@dataclass(frozen=True)
class Chunk:
    """Rows ``r0:r1`` (tokens ``t0:t1`` of the packed queries), padded to ``max_q`` queries and
    ``max_k`` keys, computed ``q_step`` queries at a time. All tensors on the compute device."""

    r0: int
    r1: int
    t0: int
    t1: int
    max_q: int
    max_k: int
    q_step: int
    row_of: torch.Tensor | None  # [t1 - t0] row within the chunk; None when every row has max_q queries
    within: torch.Tensor | None  # [t1 - t0] query index within its row
    kv_lens: torch.Tensor  # [rows, 1, 1] int64
    q_start: torch.Tensor  # [rows, 1, 1] int64: position of each row's query 0 (kv_len - q_len)
    qi: torch.Tensor  # [1, max_q, 1] int64 arange
    kj: torch.Tensor  # [1, 1, max_k] int64 arange
    pad_slots: torch.Tensor  # [slots] int64: row * max_k + j of each key slot j >= its row's kv_len
    full: bool  # every query sees every one of the max_k (>= 1) keys: no mask needed

    @property
    def rows(self) -> int:
        return self.r1 - self.r0


@dataclass(frozen=True)
class Padding:
    """Where each packed query token sits, and how the batch is cut into row chunks and query
    blocks. Holds per-token and per-row index tensors only (no mask, nothing of size
    ``max_q * max_k``). All on the compute device."""

    row_of: torch.Tensor  # [tokens] int64
    within: torch.Tensor  # [tokens] int64
    q_lens: torch.Tensor  # [rows] int64
    kv_lens: torch.Tensor  # [rows] int64
    rows: int
    max_q: int
    max_k: int
    causal: bool
    window_left: int
    heads: tuple[int, int, int]  # (Hq, Hkv, D) the chunking was sized for
    chunks: tuple[Chunk, ...]


def _row_chunks(q_lens: list[int], kv_lens: list[int], hq: int, hkv: int, d: int, budget: int
                ) -> list[tuple[int, int, int, int]]:
    """``(r0, r1, max_q, max_k)`` of consecutive row chunks within the budget (see the module
    docstring). A row without queries counts no keys: nothing of it is computed."""
    rows = len(q_lens)
    keys = [k if q else 0 for q, k in zip(q_lens, kv_lens, strict=True)]

    def fits(n: int, m: int, k: int) -> bool:
        return n * m * hq * (k + d) <= budget and n * k * 2 * hkv * d <= budget

    if rows == 0:
        return []
    if fits(rows, max(q_lens), max(keys)):
        return [(0, rows, max(q_lens), max(keys))]
    out = []
    r0 = 0
    while r0 < rows:
        m, k, r1 = q_lens[r0], keys[r0], r0 + 1
        while r1 < rows:
            m2, k2 = max(m, q_lens[r1]), max(k, keys[r1])
            if not fits(r1 + 1 - r0, m2, k2):
                break
            m, k, r1 = m2, k2, r1 + 1
        out.append((r0, r1, m, k))
        r0 = r1
    return out


def build_padding(
    q_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool, window_left: int, device: torch.device, *,
    num_qo_heads: int, num_kv_heads: int, head_dim: int, budget: int | None = None,
) -> Padding:
    """``q_lens``/``kv_lens``: int64 host tensors, one entry per row. The heads and head dim
    size the chunks; ``budget`` defaults to the module's ``SCORES_BUDGET``."""
    device = torch.device(device)
    budget = SCORES_BUDGET if budget is None else int(budget)
    ql_host = q_lens.cpu().to(torch.int64)
    kl_host = kv_lens.cpu().to(torch.int64)
    ql, kl = ql_host.tolist(), kl_host.tolist()
    rows = len(ql)
    max_q = max(ql, default=0)
    max_k = max(kl, default=0)
    q_lens = ql_host.to(device)
    kv_lens = kl_host.to(device)
    qo_host = [0]
    for n in ql:
        qo_host.append(qo_host[-1] + n)
    qo_indptr = torch.tensor(qo_host, dtype=torch.int64, device=device)
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), q_lens)
    within = torch.arange(qo_host[-1], device=device) - qo_indptr[row_of]
    q_start = kv_lens - q_lens
    chunks = []
    for r0, r1, m, k in _row_chunks(ql, kl, num_qo_heads, num_kv_heads, head_dim, budget):
        if m == 0:
            continue  # no queries: nothing to compute
        n = r1 - r0
        t0, t1 = qo_host[r0], qo_host[r1]
        step = min(m, max(1, budget // (n * num_qo_heads * (k + head_dim))))
        uniform = all(x == m for x in ql[r0:r1])
        if uniform:
            c_row_of = c_within = None
        elif n == rows:
            c_row_of, c_within = row_of, within
        else:
            c_row_of, c_within = row_of[t0:t1] - r0, within[t0:t1]
        kj = torch.arange(k, device=device)[None, None, :]
        c_kv_lens = kv_lens[r0:r1, None, None]
        pad_slots = (kj >= c_kv_lens).view(-1).nonzero()[:, 0]
        # one query per row sits at its last key (causal), and a window that long reaches key 0
        full = (k > 0 and not pad_slots.numel() and (not causal or m == 1)
                and (window_left < 0 or window_left >= k - 1))
        chunks.append(Chunk(
            r0, r1, t0, t1, m, k, step, c_row_of, c_within, c_kv_lens, q_start[r0:r1, None, None],
            torch.arange(m, device=device)[None, :, None], kj, pad_slots, full,
        ))
    return Padding(row_of, within, q_lens, kv_lens, rows, max_q, max_k, causal, window_left,
                   (num_qo_heads, num_kv_heads, head_dim), tuple(chunks))


def _block_mask(c: Chunk, a: int, b: int, causal: bool, window_left: int) -> torch.Tensor:
    """``[rows, b - a, max_k]`` bool: True where query ``a..b-1`` of each row of ``c`` may attend."""
    mask = c.kj < c.kv_lens  # [rows, 1, K]
    qpos = c.q_start + c.qi[:, a:b]  # [rows, qb, 1]
    if causal:
        mask = mask & (c.kj <= qpos)
    if window_left >= 0:
        mask = mask & (c.kj >= qpos - window_left)
    return mask.expand(c.rows, b - a, c.max_k)


@dataclass(frozen=True)
class Extras:
    """The attention features a run applies (see :mod:`mstar_core.features`): scores
    soft-capped, a sink logit per query head in each denominator, K/V read from FP8 storage as
    ``stored * scale``. The default applies none."""

    soft_cap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq]
    k_scale: float | None = None
    v_scale: float | None = None


NO_EXTRAS = Extras()


def attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: Padding, sm_scale: float | None,
    slots: tuple[tuple[torch.Tensor, ...], ...] | None = None, extras: Extras = NO_EXTRAS,
) -> torch.Tensor:
    """``q`` packed ``[tokens, Hq, D]``. Keys: with ``slots`` None, ``k``/``v`` are padded
    ``[rows, >= max_k, Hkv, D]``; otherwise ``k[slots[i]]`` / ``v[slots[i]]`` is chunk i's
    ``[chunk rows, chunk max_k, Hkv, D]`` (see :func:`gather_paged_slots`,
    :func:`gather_ragged_slots`, :func:`flat_slots`). Returns ``[tokens, Hq, D]`` in ``q``'s
    dtype; a query that sees no key gets zeros; non-finite values follow the module docstring's
    rule. On a CPU without soft-cap or sinks each block is one fused SDPA call (see
    :func:`_sdpa_block`); elsewhere scores are materialised (see :func:`_scores_block`)."""
    tokens, hq, d = q.shape
    hkv = k.shape[-2]
    if (hq, hkv, d) != pad.heads:
        raise InputError(f"attend_padded: q/k give (Hq, Hkv, D) = {(hq, hkv, d)}, the plan was built for {pad.heads}")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    # a CPU reads the finiteness check's answer for free; on an accelerator it would sync per layer
    fused = q.device.type == "cpu" and extras.soft_cap is None and extras.sinks is None
    out = torch.empty((tokens, hq, d), dtype=q.dtype, device=q.device)
    for i, c in enumerate(pad.chunks):
        n, m = c.rows, c.max_q
        if slots is None:
            k_c, v_c = k[c.r0:c.r1, :c.max_k], v[c.r0:c.r1, :c.max_k]
        else:
            k_c, v_c = _gather(k, slots[i]), _gather(v, slots[i])
        k_c, v_c = k_c.to(acc), v_c.to(acc)
        if extras.k_scale is not None:  # not in place: k_c may be the caller's tensor
            k_c = k_c * extras.k_scale
        if extras.v_scale is not None:
            v_c = v_c * extras.v_scale
        if fused:
            if c.pad_slots.numel():
                if slots is None:  # slices of the caller's tensors: not ours to zero
                    k_c, v_c = k_c.clone(), v_c.clone()
                # padding slots zeroed: under SDPA's additive mask a NaN or huge key there would leak
                k_c.view(n * c.max_k, -1).index_fill_(0, c.pad_slots, 0.0)
                v_c.view(n * c.max_k, -1).index_fill_(0, c.pad_slots, 0.0)
            kv_sum = k_c.sum() + v_c.sum()  # non-finite iff some key is (or the sum overflows)
        if c.row_of is None:
            q_c = q[c.t0:c.t1].view(n, m, hq, d)
            o_c = out[c.t0:c.t1].view(n, m, hq, d)
        else:
            q_c = q.new_zeros((n, m, hq, d), dtype=acc)
            q_c[c.row_of, c.within] = q[c.t0:c.t1].to(acc)
            o_c = None
        for a in range(0, m, c.q_step):
            b = min(m, a + c.q_step)
            q_blk = q_c[:, a:b].to(acc)
            if fused:
                clean = math.isfinite((kv_sum + q_blk.sum()).item())
                mask = None if c.full and clean else _block_mask(c, a, b, pad.causal, pad.window_left)
                o = _sdpa_block(q_blk, k_c, v_c, mask, scale, clean)
            else:
                mask = _block_mask(c, a, b, pad.causal, pad.window_left)
                o = _scores_block(q_blk, k_c, v_c, mask, scale, extras)
            if mask is not None and not c.full:
                o = o.masked_fill_(~mask.any(-1)[:, :, None, None], 0.0)  # a query that sees no key
            if o_c is not None:
                o_c[:, a:b] = o
            else:
                out[c.t0:c.t1] = o[c.row_of, c.within]
    return out


def _gather(x: torch.Tensor, slot: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``x[slot]``; one flat index through ``index_select``, several times faster on a CPU."""
    if len(slot) == 1:
        (idx,) = slot
        return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])
    return x[slot]


def _poison(q_blk: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[rows, qb, Hkv, G]`` bool: the query heads that hold a non-finite value or see a key whose
    K or V does (they must come out NaN)."""
    n, qb, hq, d = q_blk.shape
    hkv = k_c.shape[2]
    bad_kv = (~(torch.isfinite(k_c).all(-1) & torch.isfinite(v_c).all(-1))).to(k_c.dtype)  # [rows, K, Hkv]
    poison = ~torch.isfinite(q_blk).all(-1).view(n, qb, hkv, hq // hkv)
    return poison | (torch.matmul(mask.to(k_c.dtype), bad_kv) > 0)[..., None]


def _sdpa_block(q_blk: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor, mask: torch.Tensor | None,
                scale: float, clean: bool) -> torch.Tensor:
    """One query block through ``scaled_dot_product_attention``, ``[rows, qb, Hq, D]``; ``mask``
    None: every query sees every key. Unless ``clean`` (no non-finite value in the block's
    queries or the chunk's keys), the non-finite values are zeroed first and the queries that see
    them set to NaN after, so every other query's result is the same, bit for bit, as without them."""
    n, qb, hq, d = q_blk.shape
    hkv, g, kl = k_c.shape[2], hq // k_c.shape[2], k_c.shape[1]
    if clean:
        qs, ks, vs = q_blk, k_c, v_c
    else:
        qs, ks, vs = (torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in (q_blk, k_c, v_c))
    # query head h reads kv head h // G: the G heads of a kv head become G * qb query rows
    qh = qs.view(n, qb, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * qb, d)
    mh = None if mask is None else mask[:, None, None].expand(n, 1, g, qb, kl).reshape(n, 1, g * qb, kl)
    o = torch.nn.functional.scaled_dot_product_attention(
        qh, ks.transpose(1, 2), vs.transpose(1, 2), attn_mask=mh, scale=scale)
    o = o.view(n, hkv, g, qb, d).permute(0, 3, 1, 2, 4)  # [rows, qb, Hkv, G, D]
    if not clean:
        assert mask is not None  # the caller passes it wherever an input is non-finite
        o = o.masked_fill(_poison(q_blk, k_c, v_c, mask)[..., None], float("nan"))
    return o.reshape(n, qb, hq, d)


def _scores_block(q_blk: torch.Tensor, k_c: torch.Tensor, v_c: torch.Tensor, mask: torch.Tensor, scale: float,
                  extras: Extras) -> torch.Tensor:
    """One query block with its scores materialised (soft-cap, sinks, any device), ``[rows, qb, Hq, D]``.
    Masked scores are -inf, non-finite V is zeroed so that probability 0 times it stays 0, and
    the poisoned queries are set to NaN after."""
    n, qb, hq, d = q_blk.shape
    hkv, g = k_c.shape[2], hq // k_c.shape[2]
    kh = k_c.permute(0, 2, 3, 1)[:, :, None]  # [rows, Hkv, 1, D, K]
    vh = torch.nan_to_num(v_c, nan=0.0, posinf=0.0, neginf=0.0).permute(0, 2, 1, 3)[:, :, None]
    # [rows, Hkv, G, qb, D] x [rows, Hkv, 1, D, K]: query head h reads kv head h // G.
    qh = q_blk.view(n, qb, hkv, g, d).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(qh, kh).mul_(scale)
    if extras.soft_cap is not None:
        scores = scores.div_(extras.soft_cap).tanh_().mul_(extras.soft_cap)
    scores.masked_fill_(~mask[:, None, None], float("-inf"))
    if extras.sinks is not None:
        # one more "key" per head: the sink logit, with a zero value
        sink = extras.sinks.to(scores.dtype).view(1, hkv, g, 1, 1).expand(n, hkv, g, qb, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    del scores
    o = torch.matmul(probs, vh).permute(0, 3, 1, 2, 4)  # [rows, qb, Hkv, G, D]
    del probs
    o = o.masked_fill(_poison(q_blk, k_c, v_c, mask)[..., None], float("nan"))
    return o.reshape(n, qb, hq, d)


def gather_paged_slots(
    pad: Padding, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, page_size: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per chunk of ``pad``: page id and in-page offset of key j of each of its rows,
    ``[chunk rows, chunk max_k]`` and ``[1, chunk max_k]``, to index a ``[pages, page_size, ...]``
    view. Slots past a row's kv_len read page ``kv_indices[0]``; they never influence it."""
    device = pad.kv_lens.device
    kv_indptr = kv_indptr.to(device=device, dtype=torch.int64)
    kv_indices = kv_indices.to(device=device, dtype=torch.int64)
    out = []
    for c in pad.chunks:
        j = c.kj[0]  # [1, K]
        page_slot = kv_indptr[c.r0:c.r1, None] + j // page_size
        valid = j < c.kv_lens[:, :, 0]
        page_slot = torch.where(valid, page_slot, torch.zeros_like(page_slot))
        if kv_indices.numel():
            pages = kv_indices[page_slot]
        else:
            pages = torch.zeros((c.rows, c.max_k), dtype=torch.int64, device=device)
        out.append((pages, j % page_size))
    return tuple(out)


def flat_slots(slots: tuple[tuple[torch.Tensor, torch.Tensor], ...], page_rows: int
               ) -> tuple[tuple[torch.Tensor], ...]:
    """:func:`gather_paged_slots`' slots as one index each into a ``[pages * page_rows, Hkv, D]``
    view of the cache (``page_rows`` rows from one page to the next: ``2 * page_size`` for a
    ``[pages, 2, page_size, Hkv, D]`` layer, whose V view is then that view from row
    ``page_size`` on): a gather through ``index_select``."""
    return tuple(((pages * page_rows + offset),) for pages, offset in slots)


def gather_ragged_slots(pad: Padding, cu_k: torch.Tensor) -> tuple[tuple[torch.Tensor], ...]:
    """Per chunk of ``pad``: the index into packed ``[total keys, ...]`` K/V of key j of each of
    its rows, ``[chunk rows, chunk max_k]`` (``cu_k`` the rows' key offsets, ``rows + 1``
    entries). Slots past a row's kv_len read key ``cu_k[0]``; they never influence it."""
    device = pad.kv_lens.device
    cu_k = cu_k.to(device=device, dtype=torch.int64)
    out = []
    for c in pad.chunks:
        j = c.kj[0]  # [1, K]
        idx = cu_k[c.r0:c.r1, None] + j
        out.append((torch.where(j < c.kv_lens[:, :, 0], idx, cu_k[:1, None]),))
    return tuple(out)
