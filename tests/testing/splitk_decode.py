"""A split-K (flash-decoding) paged decode wrapper in plain PyTorch, and one subclass per slip
such kernels are known for. ``SplitKDecode`` computes each row in chunks of :data:`CHUNK` keys --
per chunk a maximum, ``exp(s - max)`` weights, a partial sum and a partial output, in float32 --
then merges the partials against the row's maximum (log-sum-exp). Each subclass overrides one
small step and gets it wrong; ``test_splitk_slips.py`` checks that ``mstar check`` fails each."""

from __future__ import annotations

import math

import torch

from mstar_core.attention.plans import PagedPlan
from mstar_core.backends import reference as R
from mstar_core.errors import InputError, StateError

# Keys per chunk (a split-K kernel's split), and the dtypes the wrapper computes in.
CHUNK = 64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class SplitKDecode(R.ReferenceDecodeWrapper):
    """Paged decode, one query per row, causal, with ``window_left`` and ``sm_scale``; no
    optional feature (soft-cap, sinks, FP8, multi-token rows are refused at plan or run). The
    plan is the reference's (the core's checks, a refused plan keeps the previous one); ``run``
    is split-K. A row without keys returns zeros."""

    def _plan(self, p: PagedPlan) -> None:
        who = f"{type(self).__name__}.plan"
        if p.logits_soft_cap is not None or p.sink_logits:
            raise InputError(f"{who}: soft-cap and sink logits are not implemented")
        if p.kv_data_type is not None and p.kv_data_type not in DTYPES:
            raise InputError(f"{who}: kv_data_type {p.kv_data_type} is not implemented (only {DTYPES})")
        if p.query_tokens != 1:
            raise InputError(f"{who}: {p.query_tokens} queries per row; this wrapper runs one")
        super()._plan(p)
        assert self._planned is not None
        _, lens, _, window_left, indptr, indices = self._planned
        rows = []
        for r in range(lens.shape[0]):
            n = int(lens[r])
            lo = max(0, n - 1 - window_left) if window_left >= 0 else 0  # the one query sits at n - 1
            j = torch.arange(lo, n)
            pages = indices[int(indptr[r]):int(indptr[r + 1])].to(self.device, torch.int64)
            rows.append((pages[(j // self.page_size).to(self.device)], (j % self.page_size).to(self.device)))
        self._rows = rows

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        name = type(self).__name__
        if self._planned is None:
            raise StateError(f"{name}.run before plan")
        if k_scale is not None or v_scale is not None or sinks is not None:
            raise InputError(f"{name}.run: k_scale, v_scale and sinks are not implemented")
        hq, hkv, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        if tuple(q.shape) != (len(self._rows), hq, d):
            raise InputError(f"{name}.run: q has shape {tuple(q.shape)}, expected {(len(self._rows), hq, d)}")
        if kv_cache_layer.dim() != 5 or tuple(kv_cache_layer.shape[1:]) != (2, self.page_size, hkv, d):
            raise InputError(f"{name}.run: kv_cache_layer has shape {tuple(kv_cache_layer.shape)}, expected "
                             f"[pages, 2, {self.page_size}, {hkv}, {d}]")
        scale = 1.0 / math.sqrt(d) if self._sm_scale is None else self._sm_scale
        out = q.new_zeros(q.shape)
        empty = 0
        for r, (pages, offs) in enumerate(self._rows):
            chunks = self._chunks(pages.shape[0])
            if chunks == 0:  # no key: the row stays zeros
                empty += 1
                continue
            k = kv_cache_layer[pages, 0, offs].float()  # [keys, Hkv, D]
            v = kv_cache_layer[pages, 1, offs].float()
            out[self._out_row(r, empty)] = self._attend(q[r], k, v, chunks, scale).to(q.dtype)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: int, scale: float) -> torch.Tensor:
        """One row's ``q [Hq, D]`` over its ``k``, ``v [keys, Hkv, D]`` in ``chunks`` chunks: ``[Hq, D]``."""
        hkv, d = self.num_kv_heads, self.head_dim
        pad = chunks * CHUNK - k.shape[0]
        s = self._scores(q.float().reshape(hkv, -1, d), k) * scale  # [Hkv, g, keys]
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).view(*s.shape[:2], chunks, CHUNK)
        vp = torch.cat([v, v.new_zeros((pad, hkv, d))]).view(chunks, CHUNK, hkv, d)
        m_c, p = self._chunk_weights(s, q.dtype)  # [Hkv, g, C], [Hkv, g, C, CHUNK]
        l_c, o_c = self._partials(p, vp)
        w = torch.exp(m_c - self._merge_max(m_c)[..., None])  # each partial against the row's maximum
        return self._merge(w, l_c, o_c).reshape(-1, d)

    def _scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``q [Hkv, g, D]`` . ``k [keys, Hkv, D]``: ``[Hkv, g, keys]``, unscaled."""
        return torch.einsum("hgd,khd->hgk", q, k)

    def _chunk_max(self, s: torch.Tensor) -> torch.Tensor:
        return s.amax(-1)

    def _chunk_weights(self, s: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chunk's maximum ``[..., C]`` and its weights ``exp(s - max)`` ``[..., C, CHUNK]``."""
        m_c = self._chunk_max(s)
        return m_c, torch.exp(s - m_c[..., None])

    def _partials(self, p: torch.Tensor, vp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chunk's partial sum ``[Hkv, g, C]`` and partial output ``[Hkv, g, C, D]``, in float32."""
        return p.sum(-1), torch.einsum("hgcj,cjhd->hgcd", p, vp)

    def _merge(self, w: torch.Tensor, l_c: torch.Tensor, o_c: torch.Tensor) -> torch.Tensor:
        """The partials, each weighted by ``w [Hkv, g, C]``, summed and normalised: ``[Hkv, g, D]``."""
        return (w[..., None] * o_c).sum(-2) / (w * l_c).sum(-1)[..., None]

    def _merge_max(self, m_c: torch.Tensor) -> torch.Tensor:
        """The maximum the partials are rescaled against: the row's, over every chunk."""
        return m_c.amax(-1)

    def _chunks(self, keys: int) -> int:
        return -(-keys // CHUNK)

    def _out_row(self, row: int, empty_before: int) -> int:
        """Where row ``row``'s output goes (``empty_before`` rows before it had no key)."""
        return row


class SplitKMergeLastChunkMax(SplitKDecode):
    """The partials rescaled against the last chunk's maximum, not the row's: ``exp(m_c - m_last)``
    overflows where an earlier chunk's maximum is ~88 above the last one's."""

    def _merge_max(self, m_c: torch.Tensor) -> torch.Tensor:
        return m_c[..., -1]


class SplitKFp16ExpWithoutMax(SplitKDecode):
    """A float16 fast path: ``exp(score)`` in float16, the maximum not subtracted (fine for scores
    of a few units; inf past ~11)."""

    def _chunk_weights(self, s: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype != torch.float16:
            return super()._chunk_weights(s, dtype)
        return s.new_zeros(s.shape[:-1]), torch.exp(s.half()).float()


class SplitKMaxFromZero(SplitKDecode):
    """The running maximum starts at 0, not -inf: where every score is below ~-104, every weight
    ``exp(s - 0)`` underflows to 0 and the row divides 0 by 0."""

    def _chunk_max(self, s: torch.Tensor) -> torch.Tensor:
        return s.amax(-1).clamp(min=0.0)


class SplitKBf16Accumulators(SplitKDecode):
    """The running sums kept in bfloat16 registers (8 significant bits), each add rounded: a
    chunk's partial sum and output, key by key, and the merge, chunk by chunk."""

    def _partials(self, p: torch.Tensor, vp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bf16 = torch.bfloat16
        l_c = p.new_zeros(p.shape[:-1], dtype=bf16)
        o_c = p.new_zeros((*p.shape[:-1], vp.shape[-1]), dtype=bf16)
        for j in range(CHUNK):  # every chunk's j-th key at once
            l_c = l_c + p[..., j].to(bf16)
            o_c = o_c + (p[..., j, None] * vp[:, j].permute(1, 0, 2)[:, None]).to(bf16)
        return l_c, o_c

    def _merge(self, w: torch.Tensor, l_c: torch.Tensor, o_c: torch.Tensor) -> torch.Tensor:
        bf16 = torch.bfloat16
        total = l_c.new_zeros(l_c.shape[:-1])
        out = o_c.new_zeros((*o_c.shape[:-2], o_c.shape[-1]))
        for c in range(w.shape[-1]):
            total = total + (w[..., c] * l_c[..., c]).to(bf16)
            out = out + (w[..., c, None] * o_c[..., c, :]).to(bf16)
        return (out / total[..., None]).float()


class SplitKFirst128Dims(SplitKDecode):
    """Scores over the first 128 head dims only (a kernel tiled for head dim 128)."""

    def _scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.einsum("hgd,khd->hgk", q[..., :128], k[..., :128])


class SplitKEmptyRowNaN(SplitKDecode):
    """A row with no pages run as one chunk of padding: its maximum is -inf, and its weights
    ``exp(-inf - -inf)`` NaN."""

    def _chunks(self, keys: int) -> int:
        return max(1, super()._chunks(keys))


class SplitKRowsShiftedAfterEmpty(SplitKDecode):
    """Outputs written in order of the rows that have keys: after a row with none, every row's
    output lands one row early."""

    def _out_row(self, row: int, empty_before: int) -> int:
        return row - empty_before
