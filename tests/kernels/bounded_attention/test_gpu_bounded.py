"""The compiled Triton kernels on a CUDA GPU: conformance against the reference, the manager
end to end against the oracle, ieee determinism, and a CUDA graph replay."""

from __future__ import annotations

import random

import pytest
import torch

from mstar_core import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedStep,
    KVStep,
    Step,
    StepContext,
    StreamPosition,
    bounded_attention,
)
from mstar_core.kernels.bounded_attention import bounded_write, pick_impl
from mstar_core.kernels.bounded_attention import table as tb

from ...helpers import make_scenario, run_long

pytestmark = pytest.mark.gpu

DEV = "cuda"


def random_table(rng, B, T, slots, sink, window, n_src, row):
    used = rng.sample(range(slots), B)
    out = []
    for b in range(B):
        start = rng.choice([0, 1, sink, sink + 1, rng.randint(0, 20 * window)])
        n = rng.choice([T, rng.randint(0, T)])
        src = rng.choice([tb.NO_SOURCE] + list(range(n_src)) + ([tb.ROW_SOURCE] if row else []))
        slen = rng.choice([tb.ALL_SOURCE, rng.randint(0, 9)]) if src != tb.NO_SOURCE else 0
        out.append([used[b], start, n, min(start, sink), min(max(start - sink, 0), window), src, slen, 1])
    return torch.tensor(out, dtype=torch.int32, device=DEV)


def test_auto_picks_triton():
    assert pick_impl(torch.device(DEV)) == "triton"


CASES = [
    # (dtype, B, rows, H, G, T, D, sink, window, qw, bias, sources)
    (torch.bfloat16, 8, 1, 8, 4, 1, 128, 4, 252, None, False, False),  # decode, GQA 4
    (torch.bfloat16, 4, 2, 2, 1, 1, 64, 0, 100, 50, True, True),
    (torch.bfloat16, 3, 1, 4, 2, 37, 128, 4, 60, None, True, True),  # span < window
    (torch.bfloat16, 2, 2, 2, 1, 200, 64, 2, 64, 64, True, False),  # span > window
    (torch.float16, 5, 1, 2, 8, 3, 96, 1, 33, 7, False, True),  # D not a power of 2
    (torch.float32, 3, 1, 2, 2, 17, 64, 3, 40, None, True, True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{str(c[0])[6:]}-B{c[1]}-T{c[5]}-D{c[6]}-qw{c[9]}" for c in CASES])
@pytest.mark.parametrize("ieee", [False, True])
def test_triton_matches_reference(case, ieee):
    dtype, B, rows, H, G, T, D, sink, window, qw, bias, sources = case
    rng = random.Random(T * 7 + D)
    torch.manual_seed(T + D)
    slots = B + 2
    table = random_table(rng, B, T, slots, sink, window, 2 if sources else 0, sources)
    cache = torch.randn(slots, rows, H, sink + window, 2 * D, device=DEV, dtype=dtype)
    q = torch.randn(B * rows, H * G, T, D, device=DEV, dtype=dtype)
    k, v = (torch.randn(B * rows, H, T, D, device=DEV, dtype=dtype) for _ in range(2))
    nb = window + 1 if qw is not None else window + T
    kw = dict(sink=sink, window=window, query_window=qw,
              source=torch.randn(2, rows, H, 9, 2 * D, device=DEV, dtype=dtype) if sources else None,
              row_source=(torch.randn(B, rows, H, 5, 2 * D, device=DEV, dtype=dtype),
                          torch.randperm(B, device=DEV)) if sources else None,
              rel_bias=torch.randn(B * rows, H * G, T, nb, device=DEV) if bias else None, ieee=ieee)
    if not sources:
        table[:, tb.SOURCE] = tb.NO_SOURCE
    ref = bounded_attention(q.double(), k.double(), v.double(), cache.double(), table, impl="reference",
                            **{**kw, "source": None if kw["source"] is None else kw["source"].double(),
                               "row_source": None if kw["row_source"] is None else
                               (kw["row_source"][0].double(), kw["row_source"][1])})
    out = bounded_attention(q, k, v, cache, table, impl="triton", **kw)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    tol = {torch.float32: 1e-5 if ieee else 3e-3, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert err < tol, f"relative error {err:.3g}"
    c_ref, c_tri = cache.clone(), cache.clone()
    bounded_write(c_ref, k, v, table, sink=sink, window=window, impl="reference")
    bounded_write(c_tri, k, v, table, sink=sink, window=window, impl="triton")
    assert torch.equal(c_ref, c_tri)


def test_manager_on_gpu_matches_oracle():
    for qw in (None, 6):
        cfg = BoundedKVConfig(num_layers=2, max_slots=4, rows=2, num_heads=2, head_dim=64, sink=3, window=9,
                              query_window=qw)
        sc = make_scenario(cfg, device=DEV, dtype=torch.float32, seed=31, gqa=2, rel_bias=True, sources=2,
                     row_source=True, ieee=True)
        assert sc.mgr.can_capture()
        run_long(sc, n_steps=25, max_span=13)


def test_ieee_bit_identical_on_gpu():
    torch.manual_seed(0)
    B, H, G, T, D, sink, window = 16, 4, 2, 9, 128, 4, 500
    table = random_table(random.Random(0), B, T, B, sink, window, 0, False)
    cache = torch.randn(B, 1, H, sink + window, 2 * D, device=DEV)
    q = torch.randn(B, H * G, T, D, device=DEV)
    k, v = (torch.randn(B, H, T, D, device=DEV) for _ in range(2))
    runs = [bounded_attention(q, k, v, cache, table, sink=sink, window=window, ieee=True) for _ in range(5)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    ref = bounded_attention(q.double(), k.double(), v.double(), cache.double(), table, sink=sink, window=window,
                            impl="reference")
    assert ((runs[0].double() - ref).norm() / ref.norm()).item() < 1e-5  # no TF32


def test_cuda_graph_replay_follows_new_plans():
    cfg = BoundedKVConfig(num_layers=1, max_slots=8, rows=1, num_heads=2, head_dim=64, sink=2, window=30)
    mgr = BoundedKVManager(cfg, DEV, kv_dtype=torch.bfloat16)
    eager = BoundedKVManager(cfg, DEV, kv_dtype=torch.bfloat16)
    mgr.build_accelerator_graph_buffers(1, 4, 4096)
    rids = ["a", "b", "c", "d"]
    for m in (mgr, eager):
        for r in rids:
            m.ingest_request(r)
    q, k, v = (torch.randn(4, 2 * 2 if t == "q" else 2, 1, 64, device=DEV, dtype=torch.bfloat16) for t in "qkv")

    def step():
        return Step(KVStep(()), extra=(("bounded", BoundedStep(tuple(StreamPosition(r, 1) for r in rids))),))

    def prepare(m):
        # the captured manager's steps are graph steps: staged into slot 0's static table
        s, ctx = step(), (StepContext(slot=0, bucket=4) if m is mgr else StepContext())
        assert m.admit(s, ctx)
        return s, ctx, m.plan(s, ctx)

    s, ctx, plan = prepare(mgr)
    out = mgr.attend(0, q, k, v, plan=plan)  # warm-up (compiles)
    mgr.commit(s, ctx)
    torch.cuda.synchronize()
    s, ctx, plan = prepare(mgr)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mgr.attend(0, q, k, v, plan=plan)
    graph.replay()
    mgr.commit(s, ctx)
    s0, c0, p0 = prepare(eager)
    eager.attend(0, q, k, v, plan=p0)
    eager.commit(s0, c0)
    s0, c0, p0 = prepare(eager)
    eager.attend(0, q, k, v, plan=p0)
    eager.commit(s0, c0)
    for i in range(40):  # wraps the ring: the replay reads each new plan's table
        for t in (q, k, v):
            t.normal_()
        s, ctx, _ = prepare(mgr)
        graph.replay()
        mgr.commit(s, ctx)
        s0, c0, p0 = prepare(eager)
        want = eager.attend(0, q, k, v, plan=p0)
        eager.commit(s0, c0)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {i} differs from eager"
    assert torch.equal(mgr.layer(0), eager.layer(0))
