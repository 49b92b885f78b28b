"""Wrappers with one bug each, of the kinds kernel authors write: each subclasses (or wraps) a
correct reference wrapper and gets one thing wrong. ``test_planted_bugs.py`` registers each as a
third-party backend (:func:`register`) and checks that ``mstar check`` fails it, naming the rule
that caught it."""

from __future__ import annotations

import dataclasses
import math
import sys
import types
from typing import Any

import torch

from mstar_core import BackendSpec, Registry
from mstar_core.backends import reference as R
from mstar_core.testing.oracle import visible

TILE_ROWS, TILE_HEADS = 8, 16
MODULE = "mstar_planted_bugs_kit"


def register(monkeypatch: Any, plants: dict[str, tuple[Any, ...]], api_1_1: frozenset[str] = frozenset(),
             capturable: frozenset[str] = frozenset()) -> Registry:
    """A registry holding one third-party backend per plant (name -> (capability -> wrapper
    class, dtypes, features, ...)), its classes in a module put in ``sys.modules`` for the test;
    plugin API 1.1 for the names in ``api_1_1``, else 1.0; every capability declared capturable
    for the names in ``capturable``."""
    mod = types.ModuleType(MODULE)
    monkeypatch.setitem(sys.modules, MODULE, mod)
    reg = Registry(discover=False)
    for name, (classes, dtypes, features, *_) in plants.items():
        provides = {}
        for cap, cls in classes.items():
            attr = f"{name}_{cap}"
            setattr(mod, attr, cls)
            provides[cap] = f"{MODULE}:{attr}"
        reg.register(BackendSpec(name=name, provides=provides, devices=("cpu", "cuda"), dtypes=dtypes,
                                 features=features, api_version="1.1" if name in api_1_1 else "1.0",
                                 capturable=tuple(classes) if name in capturable else ()))
    return reg


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def as_if_contiguous(t: torch.Tensor) -> torch.Tensor:
    """What a kernel that takes ``t.data_ptr()`` and assumes a packed layout reads."""
    return t.as_strided(t.shape, _contiguous_strides(t.shape), t.storage_offset())


# -- rows tiled by 8, later tiles reading the queries at tile-local offsets -------------------------


class DecodeRowTiles(R.ReferenceDecodeWrapper):
    """Rows in tiles of 8, each a sub-plan; a tile's queries are read at its local row index."""

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=torch.bfloat16, kv_lens=None,
             window_left=-1, **kwargs):
        rows = paged_kv_indptr.numel() - 1
        indptr = paged_kv_indptr.cpu()
        tiles = []
        for t0 in range(0, rows, TILE_ROWS):
            t1 = min(rows, t0 + TILE_ROWS)
            p0, p1 = int(indptr[t0]), int(indptr[t1])
            sub = R.ReferenceDecodeWrapper(None, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                                           device=self.device)
            sub.plan(indptr[t0:t1 + 1] - p0, paged_kv_indices[p0:p1], paged_kv_last_page_len[t0:t1], dtype=dtype,
                     kv_lens=None if kv_lens is None else kv_lens[t0:t1], window_left=window_left, **kwargs)
            tiles.append((t0, t1, sub))
        self._tiles = tiles

    def run(self, q, kv_cache_layer, **kwargs):
        out = q.new_empty(q.shape)
        for t0, t1, sub in self._tiles:
            local = torch.arange(t1 - t0, device=q.device)  # the tile's rows, from its first (meant t0 + local)
            out[t0:t1] = sub.run(q[local], kv_cache_layer, **kwargs)
        return out


# -- query heads tiled by 16, later tiles reading KV heads at the tile-local index ----------------


class PrefillHeadTiles(R.ReferencePrefillWrapper):
    """Query heads in tiles of 16, each its own sub-plan; a tile reads KV heads from 0."""

    def plan(self, *args, **kwargs):
        hq, hkv = self.num_qo_heads, self.num_kv_heads
        group = hq // hkv
        subs = []
        for h0 in range(0, hq, TILE_HEADS):
            size = min(TILE_HEADS, hq - h0)
            sub = R.ReferencePrefillWrapper(None, size, max(1, size // group), self.head_dim, self.page_size,
                                            device=self.device)
            sub.plan(*args, **kwargs)
            subs.append((h0, sub))
        self._subs = subs

    def run(self, q, kv_cache_layer, sinks=None, **kwargs):
        out = q.new_empty(q.shape)
        for h0, sub in self._subs:
            h1 = h0 + sub.num_qo_heads
            kv0 = 0  # the tile's first KV head, local to the tile (meant h0 // group)
            layer = kv_cache_layer[:, :, :, kv0:kv0 + sub.num_kv_heads]
            tile_sinks = None if sinks is None else sinks[h0:h1]
            out[:, h0:h1] = sub.run(q[:, h0:h1], layer, sinks=tile_sinks, **kwargs)
        return out


# -- window_left kept on the class: the last planned wrapper's window serves every layer ---------


class RaggedClassWindow(R.ReferencePrefixedPrefillWrapper):
    window_left = -1  # the kernel's launch parameter, set by plan (on the class, not the instance)

    def plan(self, cu_q, cu_k, max_q, max_k, causal=True, dtype=torch.bfloat16, sm_scale=None, window_left=-1,
             **kwargs):
        super().plan(cu_q, cu_k, max_q, max_k, causal, dtype, sm_scale, window_left, **kwargs)
        type(self).window_left = window_left
        self._args = (cu_q, cu_k, max_q, max_k, causal, dtype, sm_scale, kwargs)
        self._built_for = window_left

    def run(self, q, k, v, **kwargs):
        if self._built_for != type(self).window_left:  # launched with the class's window
            cu_q, cu_k, max_q, max_k, causal, dtype, sm_scale, kw = self._args
            super().plan(cu_q, cu_k, max_q, max_k, causal, dtype, sm_scale, type(self).window_left, **kw)
            self._built_for = type(self).window_left
        return super().run(q, k, v, **kwargs)


# -- multi-token decode rows routed to a decode kernel without the causal mask --------------------


class PrefillMultiTokenNoCausal(R.ReferencePrefillWrapper):
    """Uniform rows of 2..8 queries go to the 'decode' path, which sees every key."""

    def plan(self, qo_indptr, *args, causal=True, **kwargs):
        q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        if len(set(q_lens)) == 1 and 2 <= q_lens[0] <= 8:
            causal = False
        super().plan(qo_indptr, *args, causal=causal, **kwargs)


class DecodeMultiTokenNoCausal(R.ReferenceDecodeWrapper):
    """Multi-token rows on a decode wrapper that declares them (plugin API 1.1): every query of
    a row sees every key of the row."""

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=torch.bfloat16, kv_lens=None,
             window_left=-1, query_tokens=1, **kwargs):
        if query_tokens == 1:
            return super().plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=dtype,
                                kv_lens=kv_lens, window_left=window_left, **kwargs)
        plan = self._loose(None, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, True, dtype, kv_lens,
                           window_left, query_tokens, kwargs)
        self._plan(dataclasses.replace(plan, causal=False))


# -- the output: a view of a buffer the wrapper keeps ---------------------------------------------


class DecodePersistentOutput(R.ReferenceDecodeWrapper):
    def run(self, q, kv_cache_layer, **kwargs):
        out = super().run(q, kv_cache_layer, **kwargs)
        buf = getattr(self, "_out", None)
        if buf is None or buf.shape[0] < q.shape[0] or buf.shape[1:] != q.shape[1:] or buf.dtype != q.dtype:
            buf = self._out = q.new_empty((max(q.shape[0], 64), *q.shape[1:]))
        buf[: q.shape[0]].copy_(out)
        return buf[: q.shape[0]]


# -- a random split count, partial results rounded to bf16 ---------------------------------------


def split_kv_attend(q, k, v, causal, window_left, scale, splits):
    """One segment, the keys in ``splits`` chunks, each chunk's normalised output stored in
    bfloat16 (as a split-KV kernel's partial buffer) and merged by log-sum-exp."""
    n, m = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    s = s.masked_fill(~visible(n, m, causal, window_left), float("-inf"))
    bounds = torch.linspace(0, m, splits + 1).round().long().tolist()
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:], strict=False):
        part = s[..., a:b]
        mx = part.amax(-1, keepdim=True).nan_to_num(neginf=0.0) if b > a else torch.zeros(*s.shape[:2], 1)
        p = torch.exp(part - mx)
        denom = p.sum(-1, keepdim=True)
        o = torch.einsum("hqk,khd->hqd", p, vf[a:b]) / denom
        outs.append(o.nan_to_num(0.0).to(torch.bfloat16).float())  # the partial buffer is bf16
        lses.append((mx + denom.log()).squeeze(-1))
    lse = torch.stack(lses)  # [splits, H, q]
    weights = torch.softmax(lse, dim=0).nan_to_num(0.0)
    out = (weights[..., None] * torch.stack(outs)).sum(0)  # [H, q, D]
    return out.permute(1, 0, 2).to(q.dtype)


class RaggedRandomSplits(R.ReferencePrefixedPrefillWrapper):
    def plan(self, cu_q, cu_k, max_q, max_k, causal=True, dtype=torch.bfloat16, sm_scale=None, window_left=-1,
             **kwargs):
        super().plan(cu_q, cu_k, max_q, max_k, causal, dtype, sm_scale, window_left, **kwargs)
        self._bounds = list(zip(cu_q.tolist(), cu_k.tolist(), strict=True))
        self._mask = (causal, window_left, 1.0 / math.sqrt(self.head_dim) if sm_scale is None else sm_scale)

    def run(self, q, k, v, **kwargs):
        causal, window_left, scale = self._mask
        out = q.new_zeros(q.shape)
        for (q0, k0), (q1, k1) in zip(self._bounds, self._bounds[1:], strict=False):
            splits = int(torch.randint(1, 5, ()))  # the kernel's heuristic: whatever the occupancy gives
            out[q0:q1] = split_kv_attend(q[q0:q1], k[k0:k1], v[k0:k1], causal, window_left, scale, splits)
        return out


# -- q (and k/v) read as if contiguous ----------------------------------------------------------


class RaggedAssumesContiguous(R.ReferencePrefixedPrefillWrapper):
    def run(self, q, k, v, **kwargs):
        return super().run(as_if_contiguous(q), as_if_contiguous(k), as_if_contiguous(v), **kwargs)


class DecodeAssumesContiguous(R.ReferenceDecodeWrapper):
    def run(self, q, kv_cache_layer, **kwargs):
        return super().run(as_if_contiguous(q), kv_cache_layer, **kwargs)


# -- a window applied only under the causal mask ------------------------------------------------


class PrefillWindowOnlyCausal(R.ReferencePrefillWrapper):
    def plan(self, *args, causal=True, window_left=-1, **kwargs):
        super().plan(*args, causal=causal, window_left=window_left if causal else -1, **kwargs)


# -- the last page gathered whole, its unused slots masked in the scores only --------------------


class DecodeWholeLastPage(R.ReferenceDecodeWrapper):
    """One row at a time: every slot of the row's pages gathered, the slots past its length
    masked in the scores -- and multiplied by their (zero) weights in the values."""

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=torch.bfloat16, kv_lens=None,
             window_left=-1, **kwargs):
        super().plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype, kv_lens, window_left, **kwargs)
        indptr, last = paged_kv_indptr.tolist(), paged_kv_last_page_len.tolist()
        self._rows = [(paged_kv_indices[indptr[i]:indptr[i + 1]].long(),
                       (indptr[i + 1] - indptr[i] - 1) * self.page_size + last[i]) for i in range(len(last))]
        sm_scale = kwargs.get("sm_scale")
        self._mask = (window_left, 1.0 / math.sqrt(self.head_dim) if sm_scale is None else sm_scale)

    def run(self, q, kv_cache_layer, **kwargs):
        if kwargs:
            return super().run(q, kv_cache_layer, **kwargs)
        window_left, scale = self._mask
        group = self.num_qo_heads // self.num_kv_heads
        out = q.new_zeros(q.shape)
        for i, (pages, n) in enumerate(self._rows):
            kv = kv_cache_layer[pages.to(kv_cache_layer.device)]
            k = kv[:, 0].reshape(-1, self.num_kv_heads, self.head_dim).float().repeat_interleave(group, 1)
            v = kv[:, 1].reshape(-1, self.num_kv_heads, self.head_dim).float().repeat_interleave(group, 1)
            s = torch.einsum("hd,khd->hk", q[i].float(), k) * scale
            j = torch.arange(k.shape[0], device=q.device)
            allowed = j < n
            if window_left >= 0:
                allowed &= j >= n - 1 - window_left
            p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
            out[i] = torch.einsum("hk,khd->hd", p, v).to(q.dtype)
        return out


# -- a refused plan that has already replaced the scale and the window ---------------------------


class DecodeChangesThenValidates(R.ReferenceDecodeWrapper):
    """``plan`` takes the new scale and window first, then checks its arguments."""

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=torch.bfloat16, kv_lens=None,
             window_left=-1, **kwargs):
        self._sm_scale = kwargs.get("sm_scale")
        if self._planned is not None:
            self._planned = (*self._planned[:3], window_left, *self._planned[4:])
            self._pad = None
        super().plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype, kv_lens, window_left, **kwargs)


# -- the output: where it is allocated, what dtype it is cast to ---------------------------------


class DecodeOutputOnCurrentDevice(R.ReferenceDecodeWrapper):
    """The output allocated on ``"cuda"``, the current device, not q's."""

    def run(self, q, kv_cache_layer, **kwargs):
        out = super().run(q, kv_cache_layer, **kwargs)
        res = torch.empty(out.shape, dtype=out.dtype, device=torch.device(self.device.type))
        return res.copy_(out)


class DecodeOutputOnHost(R.ReferenceDecodeWrapper):
    """A result assembled on the host and not moved back."""

    def run(self, q, kv_cache_layer, **kwargs):
        return super().run(q, kv_cache_layer, **kwargs).cpu()


class DecodeCastToPlanDtype(R.ReferenceDecodeWrapper):
    def plan(self, *args, dtype=torch.bfloat16, **kwargs):
        self._out_dtype = dtype
        super().plan(*args, dtype=dtype, **kwargs)

    def run(self, q, kv_cache_layer, **kwargs):
        return super().run(q, kv_cache_layer, **kwargs).to(self._out_dtype)


class DecodeCastToCacheDtype(R.ReferenceDecodeWrapper):
    """``dtype`` taken for the cache's: the output cast to the cache's storage dtype."""

    def run(self, q, kv_cache_layer, **kwargs):
        return super().run(q, kv_cache_layer, **kwargs).to(kv_cache_layer.dtype)


# -- the output written into q ------------------------------------------------------------------


class RaggedWritesQ(R.ReferencePrefixedPrefillWrapper):
    def run(self, q, k, v, **kwargs):
        return q.copy_(super().run(q, k, v, **kwargs))


class DecodeWritesQ(R.ReferenceDecodeWrapper):
    def run(self, q, kv_cache_layer, **kwargs):
        return q.copy_(super().run(q, kv_cache_layer, **kwargs))
