"""The float64 oracle: one request at a time, written for clarity, not speed."""

from __future__ import annotations

import math

import torch


def visible(q_len: int, kv_len: int, causal: bool, window_left: int) -> torch.Tensor:
    """``[q_len, kv_len]``: which keys each query sees (bottom-right alignment, as below)."""
    pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len)[None, :]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        allowed &= j <= pos
    if window_left >= 0:
        allowed &= j >= pos - window_left
    return allowed


def attention_oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, window_left: int = -1,
    sm_scale: float | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request: ``q [q_len, Hq, D]`` over ``k``/``v [kv_len, Hkv, D]``, in float64.

    Query i sits at position ``kv_len - q_len + i`` (bottom-right alignment); it sees key j when
    ``j <= pos`` (if causal) and ``j >= pos - window_left`` (if ``window_left >= 0``). A query that
    sees no key returns zeros. ``soft_cap``: scores (after ``sm_scale``) become
    ``soft_cap * tanh(score / soft_cap)``. ``sinks [Hq]``: head h's softmax denominator gains
    ``exp(sinks[h])`` (a key with that logit and a zero value). FP8 K/V: pass them dequantized."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    q_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    # query head h reads kv head h // g: heads grouped, so long rows' keys are not copied g times
    scores = torch.einsum("qhgd,khd->hgqk", q.reshape(q_len, hkv, g, d), k).reshape(hq, q_len, kv_len) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~visible(q_len, kv_len, causal, window_left), float("-inf"))
    if sinks is not None:
        sink = sinks.detach().to("cpu", torch.float64)[:, None, None].expand(hq, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return torch.einsum("hgqk,khd->qhgd", probs.reshape(hkv, g, q_len, kv_len), v).reshape(q_len, hq, d)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; inf if ``out`` holds a NaN or an Inf."""
    out64 = out.detach().to("cpu", torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref.norm().item() or 1.0
    return (out64 - ref).norm().item() / denom
