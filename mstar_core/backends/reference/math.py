"""Vectorised attention over padded rows: the reference backend's one piece of arithmetic.

Rows are padded to the longest query and key length of the batch; masks remove the padding,
apply the causal mask aligned bottom-right (query i of a row with q_len queries and kv_len keys
sits at position ``kv_len - q_len + i``) and ``window_left``. No Python loop over tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Padding:
    """Where each packed query token sits in the padded ``[rows, max_q]`` grid, and the mask
    every layer of the step reuses. All on the compute device."""

    row_of: torch.Tensor  # [tokens] int64
    within: torch.Tensor  # [tokens] int64
    mask: torch.Tensor  # [rows, 1, 1, max_q, max_k] bool: True where a query may attend
    rows: int
    max_q: int
    max_k: int


def build_padding(
    q_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool, window_left: int, device: torch.device
) -> Padding:
    """``q_lens``/``kv_lens``: int64 host tensors, one entry per row."""
    q_lens = q_lens.to(device=device, dtype=torch.int64)
    kv_lens = kv_lens.to(device=device, dtype=torch.int64)
    rows = int(q_lens.numel())
    max_q = int(q_lens.max()) if rows else 0
    max_k = int(kv_lens.max()) if rows else 0
    qo_indptr = torch.zeros(rows + 1, dtype=torch.int64, device=device)
    qo_indptr[1:] = torch.cumsum(q_lens, 0)
    total = int(qo_indptr[-1]) if rows else 0
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), q_lens)
    within = torch.arange(total, device=device) - qo_indptr[row_of]
    qi = torch.arange(max_q, device=device)[None, :, None]
    kj = torch.arange(max_k, device=device)[None, None, :]
    mask = kj < kv_lens[:, None, None]
    qpos = (kv_lens - q_lens)[:, None, None] + qi
    if causal:
        mask = mask & (kj <= qpos)
    if window_left >= 0:
        mask = mask & (kj >= qpos - window_left)
    return Padding(row_of, within, mask[:, None, None], rows, max_q, max_k)


def attend_padded(
    q: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor, pad: Padding, sm_scale: float | None
) -> torch.Tensor:
    """``q`` packed ``[tokens, Hq, D]``; ``k_pad``/``v_pad`` ``[rows, max_k, Hkv, D]``.
    Returns ``[tokens, Hq, D]`` in ``q``'s dtype; a query that sees no key gets zeros."""
    tokens, hq, d = q.shape
    hkv = k_pad.shape[2]
    g = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    q_pad = q.new_zeros((pad.rows, pad.max_q, hq, d), dtype=acc)
    q_pad[pad.row_of, pad.within] = q.to(acc)
    # [rows, Hkv, G, max_q, D] x [rows, Hkv, 1, D, max_k]: query head h reads kv head h // G.
    qh = q_pad.view(pad.rows, pad.max_q, hkv, g, d).permute(0, 2, 3, 1, 4)
    kh = k_pad.to(acc).permute(0, 2, 3, 1)[:, :, None]
    vh = v_pad.to(acc).permute(0, 2, 1, 3)[:, :, None]
    scores = torch.matmul(qh, kh) * scale
    scores = scores.masked_fill(~pad.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows that see no key: all -inf -> NaN -> 0
    out = torch.matmul(probs, vh)  # [rows, Hkv, G, max_q, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(pad.rows, pad.max_q, hq, d)
    return out[pad.row_of, pad.within].to(q.dtype)


def gather_paged_slots(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor, page_size: int, max_k: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page id and in-page offset of key j of each row, ``[rows, max_k]`` each (padding reads
    page ``kv_indices[0]`` or 0; the mask hides it)."""
    kv_indptr = kv_indptr.to(device=device, dtype=torch.int64)
    kv_indices = kv_indices.to(device=device, dtype=torch.int64)
    rows = kv_indptr.numel() - 1
    j = torch.arange(max_k, device=device)[None, :]
    page_slot = kv_indptr[:-1, None] + j // page_size
    valid = j < kv_lens.to(device=device, dtype=torch.int64)[:, None]
    page_slot = torch.where(valid, page_slot, torch.zeros_like(page_slot))
    pages = kv_indices[page_slot] if kv_indices.numel() else torch.zeros((rows, max_k), dtype=torch.int64, device=device)
    return pages, (j % page_size).expand(rows, max_k)
