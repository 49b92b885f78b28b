"""The host work of planning a decode step grows with its rows, not with the context
they hold (persistent page tables, indices gathered on the device). A ratio of two medians
measured interleaved in one process, not a time: the machine's speed cancels out."""

import statistics
import time

import pytest
import torch

from mstar_core import (
    GraphRunner,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
)

from ..helpers import REF_WRAPPERS

ROWS, PS = 64, 16


def decode_setup(context: int, graphs: bool):
    """64 requests holding ``context`` tokens each (laid down without a forward), the reference
    backend, one-layer cache with narrow heads (the cost measured is per row, not per byte)."""
    pages = ROWS * (context // PS + 2) + 2 * ROWS + 2
    kvc = KVConfig(1, 1, 4, PS, pages, 1)
    kv = KVManager(kvc, "cpu", torch.float32)
    attn = PagedAttentionManager(kv, "cpu", torch.float32, kvc, REF_WRAPPERS, accelerator_graph=graphs,
                                 max_batch_size=ROWS)
    node = Node([kv, attn])
    runner = GraphRunner(node, lambda ctx, t: torch.zeros(t.shape[0], 2), [ROWS], "cpu", "text")
    if graphs:
        runner.warmup()
    rids = [f"r{i}" for i in range(ROWS)]
    for r in rids:
        node.ingest_request(r)
    assert node.step(Step(KVStep(tuple(KVSpan(r, "text", context) for r in rids))), lambda ctx: None).outcome
    decode = Step(KVStep(tuple(KVSpan(r, "text", 1) for r in rids)))
    return runner, decode


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_prepare_cost_grows_with_rows_not_context(graphs):
    short, long = decode_setup(512, graphs), decode_setup(8192, graphs)
    times: dict[int, list[float]] = {0: [], 1: []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: an intra-op thread pool only adds jitter here
    try:
        _time_prepares(short, long, times)
    finally:
        torch.set_num_threads(threads)
    ratio = statistics.median(times[1]) / statistics.median(times[0])
    # 16x the context: without persistent page tables this was 6.2x
    assert ratio <= 1.3, f"prepare at {ROWS} x 8192 costs {ratio:.2f}x prepare at {ROWS} x 512"


def _time_prepares(short, long, times) -> None:
    for i in range(2 * 151):  # interleaved: drift of the machine hits both alike
        runner, decode = (short, long)[i % 2]
        t0 = time.perf_counter()
        prep = runner.prepare(decode)
        times[i % 2].append(time.perf_counter() - t0)
        assert prep.outcome
        runner.discard(prep)
