"""BoundedKVManager + the reference kernel against a keep-everything oracle."""

from __future__ import annotations

import pytest
import torch

from mstar_core import BoundedKVConfig

from ...helpers import make_scenario, rel_err, run_long

CASES = {
    # id: (config overrides, scenario options)
    "plain": (dict(), dict()),
    "no-sink": (dict(sink=0), dict()),
    "gqa4-rows3": (dict(rows=3), dict(gqa=4)),
    "sources": (dict(rows=2), dict(sources=2, row_source=True)),
    "bias-nowin": (dict(), dict(rel_bias=True, gqa=2)),
    "qwin": (dict(query_window=4), dict()),
    "qwin-bias-sources": (dict(query_window=5, rows=2), dict(rel_bias=True, sources=1, row_source=True, gqa=2)),
    "qwin-full": (dict(query_window=7), dict(rel_bias=True)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_long_streams_match_oracle(case):
    over, opts = CASES[case]
    cfg = BoundedKVConfig(**{**dict(num_layers=2, max_slots=4, rows=1, num_heads=2, head_dim=8,
                                    sink=3, window=7), **over})
    sc = make_scenario(cfg, seed=hash(case) % 1000, **opts)
    run_long(sc, n_steps=40, max_span=11)
    # Long enough to wrap the ring many times.
    assert max(sc.mgr.length(r) for r in "abc") > 8 * cfg.window


def test_query_window_is_split_independent():
    """With a query window, one 30-token step and 30 one-token steps give the same outputs."""
    cfg = BoundedKVConfig(num_layers=1, max_slots=2, rows=1, num_heads=2, head_dim=8, sink=2, window=6, query_window=6)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 8) for _ in range(3))
    from mstar_core import (
        BoundedKVManager,
        BoundedStep,
        KVStep,
        Step,
        StepContext,
        StreamPosition,
    )

    def run(chunks):
        mgr = BoundedKVManager(cfg, "cpu")
        mgr.ingest_request("a")
        outs, t0 = [], 0
        for n in chunks:
            step = Step(KVStep(()), extra=(("bounded", BoundedStep((StreamPosition("a", n),))),))
            ctx = StepContext()
            assert mgr.admit(step, ctx)
            mgr.plan(step, ctx)
            sl = slice(t0, t0 + n)
            outs.append(mgr.attend(0, q[:, :, sl], k[:, :, sl], v[:, :, sl]))
            mgr.commit(step, ctx)
            t0 += n
        return torch.cat(outs, dim=1)

    whole, single = run([30]), run([1] * 30)
    assert rel_err(single, whole) < 1e-5
    assert rel_err(run([7, 13, 10]), whole) < 1e-5


def test_without_query_window_a_step_sees_the_ring_and_its_own():
    """Without a query window the last query of a long step sees window + span keys: different
    from token-by-token decode, as documented (and as the oracle masks)."""
    cfg = BoundedKVConfig(num_layers=1, max_slots=2, rows=1, num_heads=1, head_dim=8, sink=1, window=4)
    sc = make_scenario(cfg, seed=3)
    sc.step(["a"], [6])
    sc.step(["a"], [9])  # longer than the window: attends all 9, writes the last 4
    for _ in range(5):
        sc.step(["a"], [1])


def test_commit_false_leaves_stream_and_slot():
    cfg = BoundedKVConfig(num_layers=1, max_slots=2, rows=1, num_heads=1, head_dim=8, sink=2, window=5)
    sc = make_scenario(cfg, seed=4)
    sc.step(["a"], [9])
    before = sc.mgr.layer(0).clone()
    sc.step(["a"], [3], commit=[False])
    assert sc.mgr.length("a") == 9
    assert torch.equal(sc.mgr.layer(0), before)
    sc.step(["a"], [2])
    assert sc.mgr.length("a") == 11
