"""Shared arithmetic of the varlen stand-ins: a loop over segments in float32, written for
clarity. Not part of any real library; the stand-in packages import it by file path."""

from __future__ import annotations

import math

import torch


def varlen_attention(q, k, v, cu_q, cu_k, scale, causal, window, softcap=0.0, sinks=None, out_dtype=None):
    """``(out [tq, Hq, D] in q's dtype, lse [Hq, tq] float32)``; bottom-right aligned masks,
    ``window = (left, right)`` with -1 for unbounded; a query that sees no key gets zeros.

    ``softcap > 0``: each score, after ``scale``, becomes ``softcap * tanh(score / softcap)``
    (before masking). ``sinks [Hq]``: one more logit per query head in every softmax: the
    probabilities are ``softmax([scores..., sinks[h]])`` with the sink's column dropped (it has
    no value), and ``lse`` includes it; a query that sees no key still gets zeros (its lse is
    then the sink). ``out_dtype`` defaults to q's dtype."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros((tq, hq, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        a, b, c, e = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if b == a:
            continue
        qs = q[a:b].float().transpose(0, 1)  # [Hq, sq, D]
        ks = k[c:e].float().repeat_interleave(g, 1).transpose(0, 1)
        vs = v[c:e].float().repeat_interleave(g, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        sq, sk = b - a, e - c
        pos = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=q.device)[None, :]
        ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        left, right = window
        if causal:
            right = 0
        if right >= 0:
            ok &= j <= pos + right
        if left >= 0:
            ok &= j >= pos - left
        s = s.masked_fill(~ok, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(hq, 1, 1).expand(hq, sq, 1)
            m = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)  # [Hq, sq], the sink included
        else:
            m = torch.logsumexp(s, dim=-1)  # [Hq, sq]
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        out[a:b] = (p @ vs).transpose(0, 1)
        lse[:, a:b] = m
    return out.to(q.dtype if out_dtype is None else out_dtype), lse


def check_common(name, q, k, v, cu_q, cu_k, dtypes):
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 3:
            raise RuntimeError(f"{name}: {n} must be [total, heads, head_dim], got {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise RuntimeError(f"{name}: {n} dtype {t.dtype} not supported (supported: {dtypes})")
        if t.stride(-1) != 1:
            raise RuntimeError(f"{name}: {n} must have a contiguous last dimension")
        if t.device != q.device:
            raise RuntimeError(f"{name}: {n} on {t.device}, q on {q.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(f"{name}: q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] % k.shape[1]:
        raise RuntimeError(f"{name}: Number of heads in key/value must divide number of heads in query")
    for t, n in ((cu_q, "cu_seqlens_q"), (cu_k, "cu_seqlens_k")):
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name}: {n} must have dtype int32, got {t.dtype}")
        if t.device != q.device:
            raise RuntimeError(f"{name}: {n} must be on the device of q ({q.device}), got {t.device}")
    if int(cu_q[-1]) != q.shape[0] or int(cu_k[-1]) != k.shape[0] or k.shape[0] != v.shape[0]:
        raise RuntimeError(f"{name}: cu_seqlens do not match the token counts of q/k/v")
