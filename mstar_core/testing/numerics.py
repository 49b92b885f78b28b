"""Scores a kernel's arithmetic must survive: logits in the hundreds, positive and negative, whose
maxima differ from one stretch of a row to the next; rows whose every score is far below zero;
and the per-row tolerance, which grows with a row's keys only as float32 summation does.

Random unit-scale queries and keys give scores of a few units, which hide every bug of the
softmax's bookkeeping: a merge of split-K partials against the wrong maximum, ``exp`` taken
without subtracting the maximum, a running maximum that starts at 0, accumulators in bf16. The
cases here shape the keys so that those bugs show, and stay exact for the float64 oracle (it
reads the values the kernel reads)."""

from __future__ import annotations

import math

import torch

# Keys per stretch of equal offset: not a power of two, so a kernel's chunks straddle stretches.
STRETCH = 96
# The largest score magnitude the shaped rows reach (before a little noise): past exp's float32
# range (88.7) and float16's (11.1), within bf16/fp16 storage of the keys.
REACH = 300.0
# A row's pattern, by name: the ranges its stretches' offsets are drawn from, in its first part and
# its second. "fall" and "rise" hold the row's maximum at one end (3/8 of its stretches) and only
# low scores at the other, so a merge against the first or the last chunk's (or split's) maximum
# overflows whatever the kernel's chunking, for any chunk of at most half the row.
HIGH, LOW, ANY = (REACH / 2, REACH), (-REACH, -REACH / 2), (-REACH, REACH)
PATTERNS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "spread": (ANY, ANY), "high": (HIGH, HIGH), "low": (LOW, LOW), "fall": (HIGH, LOW), "rise": (LOW, HIGH)}
# What a case's ``scores`` asks for: the patterns of its rows, cycled over the rows.
SCORES: dict[str, tuple[str, ...]] = {"hundreds": ("fall", "high", "rise", "spread", "low"), "below": ("low",)}
# float32's unit roundoff: summing n terms in float32 errs by at most n times it (relative).
FP32_ROUNDOFF = 2.0 ** -24
ROUNDOFF = {torch.float64: 2.0 ** -53}


def tolerance(base: float, dtype: torch.dtype, keys: int, reach: float = 0.0, head_dim: int = 0) -> float:
    """A row's tolerance (relative to the oracle): the dtype's ``base``, plus the unit roundoff
    of float32 (of float64 for float64) times ``keys`` -- the worst-case relative error of summing
    ``keys`` terms there -- and times ``reach * sqrt(head_dim)``, for scores as large as ``reach``
    (a score rounded in float32 moves its softmax weight by its own rounding error, relatively).
    So float32 accumulation passes at every length and every score, and bf16 or fp16
    accumulation (2**-8, 2**-11 a step) does not."""
    return base + (max(keys, 1) + reach * math.sqrt(head_dim)) * ROUNDOFF.get(dtype, FP32_ROUNDOFF)


def row_offsets(pattern: str, keys: int, gen: torch.Generator) -> torch.Tensor:
    """``[keys]`` score offsets for one row: one offset per stretch of :data:`STRETCH` keys from
    the pattern's ranges (the first part's stretches, then the second's), plus a few units of
    noise per key (so the top stretch's softmax spreads over several keys). A row of several
    stretches starts at its first range's end and ends at its second's: a ``fall`` row holds
    REACH first and -REACH last, a ``rise`` row the reverse, a ``spread`` row REACH first."""
    first, second = PATTERNS[pattern]
    n = max(1, -(-keys // STRETCH))
    # the high end holds 3/8 of the stretches: any half of the row (or smaller chunk) at the other end is all low
    top = max(1, n * 3 // 8)
    cut = n - top if pattern == "rise" else top
    lo = torch.tensor([first[0]] * cut + [second[0]] * (n - cut), dtype=torch.float64)
    hi = torch.tensor([first[1]] * cut + [second[1]] * (n - cut), dtype=torch.float64)
    per = lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)
    if n >= 2:
        per[0] = first[0] if pattern == "rise" else first[1]
        per[-1] = second[1] if pattern == "rise" else second[0]
    out = per.repeat_interleave(STRETCH)[:keys]
    return out + 2.0 * torch.randn(keys, generator=gen, dtype=torch.float64)


def shape_scores(scores: str, q: torch.Tensor, kv_lens: list[int], gqa: int, sm_scale: float | None,
                 gen: torch.Generator) -> list[torch.Tensor]:
    """Shape float32 queries ``q [tokens, Hq, D]`` in place, and return what to add to each row's
    keys (``[kv_len, Hkv, D]`` per row of ``kv_lens``), so that the scores follow ``scores``'
    patterns (:data:`SCORES`): key j of a row gets ``offset_j * u_h`` added, for a unit direction
    ``u_h`` per KV head, and every query becomes ``(u_h + small noise) / sm_scale``, so its score
    with key j is about ``offset_j`` (the keys' own unit-scale noise adds a little)."""
    d = q.shape[-1]
    hkv = q.shape[1] // gqa
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    u = torch.randn((hkv, d), generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    noise = torch.randn(q.shape, generator=gen) * (0.3 / math.sqrt(d))
    q.copy_((u.repeat_interleave(gqa, dim=0)[None] + noise) / scale)
    patterns = SCORES[scores]
    return [row_offsets(patterns[r % len(patterns)], n, gen).to(torch.float32)[:, None, None] * u[None]
            for r, n in enumerate(kv_lens)]
