"""``mstar warmup`` for FlashInfer: a tiny plan and run through this plugin's own wrappers for every
variant a configuration uses, so FlashInfer compiles (or loads) exactly the modules a real step
would, before the first request. The variants: each window (full attention and sliding window are
different modules), soft-cap or not (the config's), and for the paged prefill both a short-query
and a long-query plan (FlashInfer 0.7.4 runs prompts of at most 64 tokens on fa2 and longer ones on
fa3 on Hopper: two modules). Decode follows the head counts (tensor cores or not), as it will."""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mstar_core.plugin import PagedCase, PagedData, WarmedKernel, WarmupConfig, make_paged
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.jit_notice import SHORT_QUERY, built_since, describe, jit_dir
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

WORKSPACE = 128 << 20  # what FlashInfer recommends per wrapper (split-KV scratch)
QUERIES = {"short": (1, 8), "long": (1, SHORT_QUERY + 16)}  # per-row query lengths of a tiny plan


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


class _Run:
    def __init__(self, cfg: WarmupConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.ws = torch.empty(WORKSPACE if device.type == "cuda" else 1024, dtype=torch.uint8, device=device)
        self.common = (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size)
        self.extras: dict[str, Any] = {} if cfg.soft_cap is None else {"logits_soft_cap": float(cfg.soft_cap)}
        self.dir = jit_dir()

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.cfg.dtype, device=self.device)

    def data(self, q_lens: Sequence[int]) -> PagedData:
        """A tiny paged batch of this config (5 cached tokens before each row's queries)."""
        c = self.cfg
        case = PagedCase(c.page_size, c.head_dim, c.num_qo_heads // c.num_kv_heads, tuple(q_lens), (5,) * len(q_lens),
                           num_kv_heads=c.num_kv_heads)
        return make_paged(case, str(self.device), c.dtype)

    def timed(self, capability: str, variant: str, fn: Any) -> WarmedKernel:
        new = built_since(self.dir)
        t0 = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return WarmedKernel("flashinfer", capability, variant, time.perf_counter() - t0, describe(new()))

    def paged_prefill(self, window: int, queries: str) -> None:
        d = self.data(QUERIES[queries])
        w = FlashInferPrefillWrapper(self.ws, *self.common, device=self.device)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, causal=True, dtype=self.cfg.dtype,
               window_left=window, **self.extras)
        w.run(d.q, d.layer)

    def paged_decode(self, window: int) -> None:
        d = self.data((1, 1))
        w = FlashInferDecodeWrapper(self.ws, *self.common, device=self.device)
        w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=self.cfg.dtype, window_left=window, **self.extras)
        w.run(d.q, d.layer)

    def mixed(self, window: int, queries: str) -> None:
        q_lens = (1,) + QUERIES[queries][1:]
        d = self.data(q_lens)
        w = FlashInferMixedWrapper(self.ws, torch.empty_like(self.ws), *self.common, len(q_lens), d.q.shape[0],
                                   d.layer.shape[0], 1, self.device)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, causal=True, dtype=self.cfg.dtype,
               window_left=window, **self.extras)
        w.run(d.q, d.layer)

    def prefixed_ragged(self, window: int, queries: str) -> None:
        # no soft-cap here: the dense path has none, so its kernels are the plain ones whatever the config
        q_lens = QUERIES[queries]
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum([n + 5 for n in q_lens])]).astype(np.int32)
        w = FlashInferPrefixedPrefillWrapper(self.cfg.num_qo_heads, self.cfg.num_kv_heads, self.cfg.head_dim,
                                             self.device, workspace_buffer=self.ws)
        w.plan(_t(cu_q), _t(cu_k), max(q_lens), max(q_lens) + 5, causal=True, dtype=self.cfg.dtype,
               window_left=window)
        c = self.cfg
        w.run(self.rand(int(cu_q[-1]), c.num_qo_heads, c.head_dim),
              self.rand(int(cu_k[-1]), c.num_kv_heads, c.head_dim),
              self.rand(int(cu_k[-1]), c.num_kv_heads, c.head_dim))


JIT_CACHE_HINT = ("FlashInfer compiled {n} module(s) here; its prebuilt-kernel package flashinfer-jit-cache (not "
                  "installed) may hold them prebuilt: see docs/BACKENDS.md, 'First-use compiles'")


def warmup(config: WarmupConfig, device: torch.device, capabilities: Sequence[str]) -> list[WarmedKernel | str]:
    """Every variant ``config`` uses, for each of ``capabilities``, in the order an engine meets them;
    a note if anything was compiled while FlashInfer's prebuilt-kernel package is not installed."""
    r = _Run(config, device)
    new = built_since(r.dir)
    done: list[WarmedKernel | str] = []
    for window in config.windows:
        win = "full" if window < 0 else f"window {window}"
        for cap in capabilities:
            if cap == "paged_decode":
                done.append(r.timed(cap, win, functools.partial(r.paged_decode, window)))
                continue
            for queries in QUERIES:
                variant = f"{win}, {queries} queries"
                if cap == "paged_prefill":
                    done.append(r.timed(cap, variant, functools.partial(r.paged_prefill, window, queries)))
                elif cap == "mixed":
                    done.append(r.timed(cap, variant, functools.partial(r.mixed, window, queries)))
                elif cap == "prefixed_ragged":
                    done.append(r.timed(cap, variant, functools.partial(r.prefixed_ragged, window, queries)))
    compiled = len(new())
    if compiled and importlib.util.find_spec("flashinfer_jit_cache") is None:
        done.append(JIT_CACHE_HINT.format(n=compiled))
    return done
