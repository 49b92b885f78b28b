"""``mstar warmup`` for FlashInfer: a tiny plan and run through this plugin's own wrappers for every
variant a configuration uses, so FlashInfer compiles (or loads) exactly the modules a real step
would, before the first request. The variants: each window (full attention and sliding window are
different modules), soft-cap or not (the config's), and for the paged prefill both a short-query
and a long-query plan (FlashInfer 0.7.4 runs prompts of at most 64 tokens on fa2 and longer ones on
fa3 on Hopper: two modules). Decode follows the head counts (tensor cores or not), as it will."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mstar_core.warmup import WarmedKernel, WarmupConfig

from .decode import FlashInferDecodeWrapper
from .jit_notice import SHORT_QUERY, _describe, built_modules, jit_dir
from .mixed import FlashInferMixedWrapper
from .prefill import FlashInferPrefillWrapper
from .ragged import FlashInferPrefixedPrefillWrapper

WORKSPACE = 128 << 20  # what FlashInfer recommends per wrapper (split-KV scratch)
QUERIES = {"short": (1, 8), "long": (1, SHORT_QUERY + 16)}  # per-row query lengths of a tiny plan


def _paged(q_lens: Sequence[int], page_size: int, prefix: int = 5) -> dict[str, np.ndarray]:
    """Host index arrays of a tiny paged batch: row i holds ``prefix + q_lens[i]`` tokens."""
    kv = np.array([prefix + n for n in q_lens], dtype=np.int32)
    pages = -(-kv // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    return {"qo": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32), "indptr": indptr,
            "indices": np.arange(int(indptr[-1]), dtype=np.int32),
            "last": (kv - (pages - 1) * page_size).astype(np.int32), "kv_lens": kv}


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

    def layer(self, pages: int) -> torch.Tensor:
        c = self.cfg
        return self.rand(pages, 2, c.page_size, c.num_kv_heads, c.head_dim)

    def timed(self, capability: str, variant: str, fn: Any) -> WarmedKernel:
        before = built_modules(self.dir)
        t0 = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        return WarmedKernel("flashinfer", capability, variant, seconds, _describe(built_modules(self.dir) - before))

    def paged_prefill(self, window: int, queries: str) -> None:
        a = _paged(QUERIES[queries], self.cfg.page_size)
        w = FlashInferPrefillWrapper(self.ws, *self.common, device=self.device)
        w.plan(_t(a["qo"]), _t(a["indptr"]), _t(a["indices"]), _t(a["last"]), causal=True, dtype=self.cfg.dtype,
               window_left=window, **self.extras)
        w.run(self.rand(int(a["qo"][-1]), self.cfg.num_qo_heads, self.cfg.head_dim), self.layer(a["indices"].size))

    def paged_decode(self, window: int) -> None:
        a = _paged((1, 1), self.cfg.page_size)
        w = FlashInferDecodeWrapper(self.ws, *self.common, device=self.device)
        w.plan(_t(a["indptr"]), _t(a["indices"]), _t(a["last"]), dtype=self.cfg.dtype, window_left=window,
               **self.extras)
        w.run(self.rand(2, self.cfg.num_qo_heads, self.cfg.head_dim), self.layer(a["indices"].size))

    def mixed(self, window: int, queries: str) -> None:
        q_lens = (1,) + QUERIES[queries][1:]
        a = _paged(q_lens, self.cfg.page_size)
        pages = int(a["indices"].size)
        tokens = int(a["qo"][-1])
        ws2 = torch.empty_like(self.ws)
        w = FlashInferMixedWrapper(self.ws, ws2, *self.common, len(q_lens), tokens, pages, 1, self.device)
        w.plan(_t(a["qo"]), _t(a["indptr"]), _t(a["indices"]), _t(a["last"]), causal=True, dtype=self.cfg.dtype,
               window_left=window, **self.extras)
        w.run(self.rand(tokens, self.cfg.num_qo_heads, self.cfg.head_dim), self.layer(pages + 1))

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
        w.run(self.rand(int(cu_q[-1]), c.num_qo_heads, c.head_dim), self.rand(int(cu_k[-1]), c.num_kv_heads, c.head_dim),
              self.rand(int(cu_k[-1]), c.num_kv_heads, c.head_dim))


JIT_CACHE_HINT = ("FlashInfer compiled {n} module(s) here; its prebuilt-kernel package flashinfer-jit-cache (not "
                  "installed) may hold them prebuilt: see the README, 'First-use compiles'")


def warmup(config: WarmupConfig, device: torch.device, capabilities: Sequence[str]) -> list[WarmedKernel | str]:
    """Every variant ``config`` uses, for each of ``capabilities``, in the order an engine meets them;
    a note if anything was compiled while FlashInfer's prebuilt-kernel package is not installed."""
    r = _Run(config, device)
    before = built_modules(r.dir)
    done: list[WarmedKernel | str] = []
    for window in config.windows:
        win = "full" if window < 0 else f"window {window}"
        for cap in capabilities:
            if cap == "paged_decode":
                done.append(r.timed(cap, win, lambda: r.paged_decode(window)))
                continue
            for queries in QUERIES:
                variant = f"{win}, {queries} queries"
                if cap == "paged_prefill":
                    done.append(r.timed(cap, variant, lambda: r.paged_prefill(window, queries)))
                elif cap == "mixed":
                    done.append(r.timed(cap, variant, lambda: r.mixed(window, queries)))
                elif cap == "prefixed_ragged":
                    done.append(r.timed(cap, variant, lambda: r.prefixed_ragged(window, queries)))
    compiled = len(built_modules(r.dir) - before)
    if compiled and importlib.util.find_spec("flashinfer_jit_cache") is None:
        done.append(JIT_CACHE_HINT.format(n=compiled))
    return done
