"""A bounded step pads every row to the longest span (``T``): the padding query, key and value
positions past a row's tokens must never reach its real outputs, whatever they hold (NaN too),
nor what the step writes into the slots."""

import math

import pytest
import torch

from mstar_core import BoundedKVConfig, BoundedKVManager, Node, StepContext, StreamPosition

from ...helpers import bstep

H, D = 2, 8


def run(pad: float, query_window: int | None, hq: int) -> tuple[torch.Tensor, torch.Tensor, BoundedKVManager]:
    """Two steps of requests a (short rows) and b (full rows); the second step's padding holds
    ``pad``. Returns the second step's output, the storage after it, and the manager."""
    cfg = BoundedKVConfig(num_layers=1, max_slots=3, rows=1, num_heads=H, head_dim=D, sink=1, window=4,
                          query_window=query_window)
    mgr = BoundedKVManager(cfg, "cpu", torch.float64)
    mgr.impl = "reference"
    node = Node([mgr])
    for r in "ab":
        node.ingest_request(r)
    gen = torch.Generator().manual_seed(1)
    out = None
    for n_a, n_b in ((3, 2), (2, 5)):  # the second step: a has 2 tokens of T = 5
        T = max(n_a, n_b)
        q = torch.randn(2, hq, T, D, generator=gen, dtype=torch.float64)
        k = torch.randn(2, H, T, D, generator=gen, dtype=torch.float64)
        v = torch.randn(2, H, T, D, generator=gen, dtype=torch.float64)
        for x in (q, k, v):
            x[0, :, n_a:] = pad
            x[1, :, n_b:] = pad
        step = bstep(StreamPosition("a", n_a), StreamPosition("b", n_b))
        out = node.step(step, lambda ctx, q=q, k=k, v=v: mgr.attend(0, q, k, v)).output
    return out, mgr.storage.clone(), mgr


@pytest.mark.parametrize("query_window", [None, 2])
@pytest.mark.parametrize("hq", [H, 2 * H])
def test_nan_in_padding_never_reaches_real_outputs(query_window, hq):
    clean, clean_store, _ = run(0.0, query_window, hq)
    poisoned, store, mgr = run(math.nan, query_window, hq)
    assert torch.isfinite(clean).all()
    # a's two real positions and all five of b's: exactly the clean computation
    assert torch.equal(poisoned[0, :2], clean[0, :2])
    assert torch.equal(poisoned[1], clean[1])
    assert torch.equal(store, clean_store), "padding must not be written into the slots"
    # nothing held beyond the two requests' slots, nothing in flight
    mgr.post_warmup_validate()
    assert mgr.num_free_slots == 1 and mgr.length("a") == 5 and mgr.length("b") == 7
    s, ctx = bstep(StreamPosition("a", 1)), StepContext()
    assert mgr.admit(s, ctx)  # a has no step in flight
    mgr.rollback_admit(s, ctx)
