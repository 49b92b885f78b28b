"""The Triton kernels under the Triton interpreter (CPU), against the reference and the oracle.
Skipped where triton is not importable."""

from __future__ import annotations

import random

import pytest
import torch

import mstar_core.kv.bounded.manager as manager_mod
from mstar_core import BoundedKVConfig
from mstar_core.kernels.bounded_attention import table as tb
from mstar_core.kernels.bounded_attention.reference import (
    bounded_attention_reference,
    write_step_reference,
)

from ...helpers import make_scenario, run_long


def random_table(rng: random.Random, B: int, T: int, slots: int, sink: int, window: int, n_src: int, row: bool):
    rows, used = [], rng.sample(range(slots), B)
    for b in range(B):
        start = rng.choice([0, 1, sink, sink + 1, rng.randint(0, 5 * window)])
        n = rng.randint(0, T)
        src = rng.choice([tb.NO_SOURCE] + list(range(n_src)) + ([tb.ROW_SOURCE] if row else []))
        slen = rng.choice([tb.ALL_SOURCE, rng.randint(0, 3)]) if src != tb.NO_SOURCE else 0
        rows.append([used[b], start, n, min(start, sink), min(max(start - sink, 0), window), src, slen,
                     rng.randint(0, 1)])
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("T,G,D,qw,bias", [
    (1, 1, 16, None, False),
    (1, 4, 32, 3, True),
    (5, 2, 16, None, True),
    (19, 1, 24, 6, True),  # D not a power of 2; two query blocks
    (70, 1, 16, None, False),  # several own-key blocks
])
def test_kernel_matches_reference(triton_interp, T, G, D, qw, bias):
    rng = random.Random(T * 100 + G)
    gen = torch.Generator().manual_seed(T)
    B, rows, H, sink, window, slots = 3, 2, 2, 2, 6, 5
    table = random_table(rng, B, T, slots, sink, window, n_src=2, row=True)
    cache = torch.randn(slots, rows, H, sink + window, 2 * D, generator=gen)
    q = torch.randn(B * rows, H * G, T, D, generator=gen)
    k, v = (torch.randn(B * rows, H, T, D, generator=gen) for _ in range(2))
    nb = window + 1 if qw is not None else 9
    kw = dict(sink=sink, window=window, query_window=qw,
              source=torch.randn(2, rows, H, 7, 2 * D, generator=gen),
              row_source=(torch.randn(4, rows, H, 3, 2 * D, generator=gen), torch.tensor([3, 0, 2])),
              rel_bias=torch.randn(B * rows, H * G, T, nb, generator=gen) if bias else None, ieee=True)
    ref = bounded_attention_reference(q, k, v, cache, table, **kw)
    out = triton_interp.bounded_attention_triton(q, k, v, cache, table, **kw)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()
    c_ref, c_tri = cache.clone(), cache.clone()
    write_step_reference(c_ref, k, v, table, sink=sink, window=window)
    triton_interp.write_step_triton(c_tri, k, v, table, sink=sink, window=window)
    assert torch.equal(c_ref, c_tri)


def test_manager_with_triton_kernels_matches_oracle(triton_interp, monkeypatch):
    """The manager end to end with the interpreted Triton kernels in place of the reference."""
    def attn(q, k, v, cache, table, *, impl="auto", **kw):
        return triton_interp.bounded_attention_triton(q, k, v, cache, table, **kw)

    def write(cache, k, v, table, *, impl="auto", **kw):
        triton_interp.write_step_triton(cache, k, v, table, **kw)

    monkeypatch.setattr(manager_mod, "bounded_attention", attn)
    monkeypatch.setattr(manager_mod, "bounded_write", write)
    cfg = BoundedKVConfig(num_layers=1, max_slots=3, rows=2, num_heads=2, head_dim=16, sink=2, window=5, query_window=4)
    sc = make_scenario(cfg, seed=21, gqa=2, rel_bias=True, sources=1, row_source=True)
    run_long(sc, n_steps=6, max_span=6)
    assert max(sc.mgr.length(r) for r in "abc") > 2 * cfg.window
