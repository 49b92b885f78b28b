"""Bounded attention in plain, vectorised PyTorch (CPU and GPU): the reference every other
implementation is tested against. It materialises the full score matrix; it is for
correctness, not speed. The visibility rule is documented in the package ``__init__``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from mstar_core.kernels.bounded_attention import table as tb


@contextlib.contextmanager
def ieee_matmul(enabled: bool) -> Iterator[None]:
    """Turn TF32 off for the duration (cuBLAS and cuDNN) when ``enabled``."""
    if not enabled:
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def ring_positions(start: torch.Tensor, j: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Stream position held at cache index ``j`` before a step starting at ``start``.

    Index ``j < sink`` holds position ``j``; ring index ``j >= sink`` holds the latest position
    ``p < start`` with ``sink + (p - sink) % window == j``. Meaningless where nothing was written.
    """
    back = torch.remainder(start - 1 - j, window)
    return torch.where(j < sink, j, start - 1 - back)


def _split_kv(x: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x[..., :d], x[..., d:]


def bounded_attention_reference(
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
) -> torch.Tensor:
    """See :func:`mstar_core.kernels.bounded_attention.bounded_attention`."""
    B = table.shape[0]
    BR, Hq, T, D = q.shape
    rows = BR // B
    H = k.shape[1]
    G = Hq // H
    dev = q.device
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    tab = table.to(dev, torch.int64)
    slot, start, ntok = tab[:, tb.SLOT], tab[:, tb.START], tab[:, tb.NUM_TOKENS]
    sink_kept, ring_kept = tab[:, tb.SINK_KEPT], tab[:, tb.RING_KEPT]
    src, src_len = tab[:, tb.SOURCE], tab[:, tb.SOURCE_LEN]

    t = torch.arange(T, device=dev)
    qpos = start[:, None] + t  # [B, T]
    qvalid = t[None, :] < ntok[:, None]

    keys: list[torch.Tensor] = []  # each [B, rows, H, n, 2D]
    masks: list[torch.Tensor] = []  # each [B, T, n]
    kpos_stream: list[torch.Tensor] = []  # positions of the stream keys, [B, n]

    # Prefix keys (no stream position: always visible, no rel_bias).
    def prefix(store: torch.Tensor, take: torch.Tensor, is_mine: torch.Tensor) -> None:
        L = store.shape[3]
        eff = torch.where(src_len < 0, torch.full_like(src_len, L), src_len)
        j = torch.arange(L, device=dev)
        ok = is_mine[:, None] & (j[None, :] < eff[:, None])  # [B, L]
        keys.append(torch.where(ok[:, None, None, :, None], store[take], 0))  # never read junk
        masks.append(ok[:, None, :] & qvalid[:, :, None])

    if source is not None:
        prefix(source, src.clamp(min=0), src >= 0)
    if row_source is not None:
        store, slots = row_source
        prefix(store, slots[:B].to(dev, torch.int64), src == tb.ROW_SOURCE)
    n_prefix = sum(m.shape[-1] for m in masks)

    def visible(kpos: torch.Tensor, kvalid: torch.Tensor) -> torch.Tensor:
        ok = kvalid[:, None, :] & qvalid[:, :, None] & (kpos[:, None, :] <= qpos[:, :, None])
        if query_window is not None:
            # Sinks stay visible; other keys only within the query's own window.
            near = (qpos[:, :, None] - kpos[:, None, :]) <= query_window
            ok &= near | (kpos[:, None, :] < sink)
        return ok

    # Retained keys: sink region and ring, at the positions they were written for.
    cap = cache.shape[3]
    j = torch.arange(cap, device=dev)
    kpos = ring_positions(start[:, None], j[None, :], sink, window)
    kvalid = (j[None, :] < sink_kept[:, None]) | (
        (j[None, :] >= sink) & (j[None, :] < sink + ring_kept[:, None])
    )
    # Unwritten cache entries may hold anything (the cache is never zeroed); 0 * NaN would leak.
    keys.append(torch.where(kvalid[:, None, None, :, None], cache[slot], 0))
    masks.append(visible(kpos, kvalid))
    kpos_stream.append(kpos)

    # This step's own keys, causal.
    own = torch.cat([k, v], dim=-1).view(B, rows, H, T, 2 * D)
    # Positions past a row's tokens are padding, whatever they hold: a NaN there times its 0
    # probability would still be NaN in the row's real outputs.
    own = torch.where(qvalid[:, None, None, :, None], own, 0)
    kpos = qpos
    keys.append(own)
    masks.append(visible(kpos, qvalid))
    kpos_stream.append(kpos)

    with ieee_matmul(ieee):
        kv = torch.cat([x.to(cdt) for x in keys], dim=3).reshape(BR, H, -1, 2 * D)
        kk, vv = _split_kv(kv.repeat_interleave(G, dim=1), D)  # query head h reads kv head h // G
        scores = torch.matmul(q.to(cdt), kk.transpose(-1, -2)) * scale  # [BR, Hq, T, N]
        N = scores.shape[-1]
        mask = torch.cat(masks, dim=-1)  # [B, T, N]
        if rel_bias is not None:
            kp = torch.cat(kpos_stream, dim=-1)  # [B, Ns]
            nb = rel_bias.shape[-1]
            dist = (qpos[:, :, None] - kp[:, None, :]).clamp(0, nb - 1)  # [B, T, Ns]
            idx = dist[:, None, None].expand(B, rows, Hq, T, -1).reshape(BR, Hq, T, -1)
            bias = torch.gather(rel_bias.to(cdt), 3, idx)
            scores = torch.cat([scores[..., :n_prefix], scores[..., n_prefix:] + bias], dim=-1)
        full = mask[:, None, None].expand(B, rows, Hq, T, N).reshape(BR, Hq, T, N)
        scores = scores.masked_fill(~full, float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # padding queries: 0
        out = torch.matmul(probs, vv)  # [BR, Hq, T, D]
    return out.transpose(1, 2).to(q.dtype)


def write_step_reference(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, *, sink: int, window: int
) -> None:
    """Write the step's keys into their slots: positions below ``sink`` into the sink region,
    the last ``window`` of the rest into the ring. Earlier ring tokens of a span longer than the
    window would be overwritten within the same step, so they are skipped (which also keeps
    every destination unique, hence the write deterministic)."""
    B = table.shape[0]
    BR, H, T, D = k.shape
    rows = BR // B
    dev = cache.device
    tab = table.to(dev, torch.int64)
    slot, start, ntok, write = tab[:, tb.SLOT], tab[:, tb.START], tab[:, tb.NUM_TOKENS], tab[:, tb.WRITE]
    t = torch.arange(T, device=dev)
    pos = start[:, None] + t
    end = (start + ntok)[:, None]
    keep = (t[None, :] < ntok[:, None]) & (write[:, None] != 0) & ((pos < sink) | (pos >= end - window))
    dest = torch.where(pos < sink, pos, sink + torch.remainder(pos - sink, window))
    bi, ti = keep.nonzero(as_tuple=True)
    own = torch.cat([k, v], dim=-1).view(B, rows, H, T, 2 * D)
    cache[slot[bi], :, :, dest[bi, ti]] = own[bi, :, :, ti].to(cache.dtype)
