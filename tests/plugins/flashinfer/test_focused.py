"""Second, focused tests for FlashInfer-wrapper behaviours that only one other test pinned down
(issue 10): graph-mode padding rows, the prefill graph's token budget, per-slot staging of the
decode wrapper, and what ``plan`` forwards to FlashInfer. CPU, through the stand-in."""

from __future__ import annotations

import pytest
import torch

from mstar_core import (
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
    StepContext,
)
from mstar_core.testing import conformance as C
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper

from ...helpers import case, err, oracle

pytestmark = pytest.mark.usefixtures("standin_flashinfer")
WS = torch.empty(1024, dtype=torch.uint8)
F32 = torch.float32
CPU = torch.device("cpu")


def _decode_graph(batch=5, pages=40):
    return FlashInferDecodeWrapper(WS, 4, 2, 16, 4, batch_size=batch, max_num_pages=pages, device=CPU,
                                   accelerator_graph=True)


def test_decode_padding_rows_read_one_token_of_the_sink_page():
    """A graph-mode decode plan with fewer rows than ``batch_size`` is padded with rows of one
    key each: one page (the sink page) whose last page length is 1 — never 0, which no kernel
    accepts — and the real rows still match the oracle."""
    w = _decode_graph(batch=5)
    c = case((1, 1), (6, 3))
    d = C.make_paged(c, "cpu", F32)
    w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    n = d.kv_indptr[-1].item()
    indptr = w._bufs["kv_indptr"].tolist()
    assert indptr[:3] == d.kv_indptr.tolist() and indptr[3:] == [n + 1, n + 2, n + 3]
    assert w._bufs["last_page_len"].tolist() == [*d.last_page_len.tolist(), 1, 1, 1]
    assert w._bufs["kv_indices"][n:n + 3].tolist() == [w.SINK_PAGE] * 3
    q = torch.cat([d.q, torch.zeros(3, *d.q.shape[1:])])
    assert err(w.run(q, d.layer)[:2], oracle(c, d)) < 2e-5


def test_prefill_graph_takes_more_tokens_than_its_first_plan():
    """A graph-mode prefill wrapper's token budget is its static ``max_total_tokens``, not the
    token count of its first plan: a small first plan does not refuse a larger later one."""
    w = FlashInferPrefillWrapper(WS, 4, 2, 16, 4, batch_size=2, max_total_tokens=32, max_num_pages=32, device=CPU,
                                 accelerator_graph=True)
    for q_lens, prefix in (((1,), (2,)), ((9, 12), (3, 0)), ((32,), (0,))):
        c = case(q_lens, prefix)
        d = C.make_paged(c, "cpu", F32)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
        assert w.planned_tokens == sum(q_lens)
        assert err(w.run(d.q, d.layer), oracle(c, d)) < 2e-5


def test_decode_plans_alternate_staging_slots():
    """Each decode plan stages its host arrays in the next staging slot, so planning step N+1
    leaves the buffers step N's asynchronous copies read from untouched."""
    w = _decode_graph(batch=4)
    staged = []
    for i, prefix in enumerate([(5, 2), (9, 1, 4), (3,)]):
        d = C.make_paged(case((1,) * len(prefix), prefix, seed=i), "cpu", F32)
        w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
        staged.append((w._staging.slot, d.kv_indices.tolist()))
        if i == 1:
            slot0, first = staged[0]
            assert slot0 == 0 and w._staging.buffer(0, "kv_indices")[:len(first)].tolist() == first
    assert [s for s, _ in staged] == [0, 1, 0]


@pytest.mark.parametrize("make", ["prefill", "decode"])
def test_kv_data_type_reaches_flashinfers_plan(make):
    """``plan(..., kv_data_type=...)`` is forwarded to FlashInfer: a float16 cache under float32
    queries runs (FlashInfer checks the cache's dtype against what was planned) and matches the
    oracle within float16's precision."""
    c = case((1, 1, 1), (5, 8, 2)) if make == "decode" else case((3, 2), (4, 0))
    d = C.make_paged(c, "cpu", F32)
    if make == "decode":
        w = FlashInferDecodeWrapper(WS, 4, 2, 16, 4, device=CPU)
        w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_data_type=torch.float16)
    else:
        w = FlashInferPrefillWrapper(WS, 4, 2, 16, 4, device=CPU)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_data_type=torch.float16)
    half = d.layer.to(torch.float16)
    out = w.run(d.q, half)
    keys = [(k.half().double(), v.half().double()) for k, v in d.keys]  # what the float16 cache holds
    ref = oracle(c, C.PagedData(d.q, half, d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, d.kv_lens, keys))
    assert out.dtype == F32 and err(out, ref) < 2e-5



def test_graph_wrappers_have_room_for_a_page_per_padding_row():
    """The attention manager builds each graph-mode wrapper with room for the cache's pages plus
    one sink page per padding row: a graph decode step whose streams hold every page of the
    cache (but the sink) still plans when its bucket pads it with empty rows, and runs."""
    cfg = KVConfig(num_layers=1, num_kv_heads=2, head_dim=16, page_size=4, max_pages=8, num_qo_heads=4)
    kv = KVManager(cfg, "cpu", F32)
    wrappers = {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
                "mixed": FlashInferMixedWrapper}
    attn = PagedAttentionManager(kv, "cpu", F32, cfg, wrappers, accelerator_graph=True)
    node = Node([kv, attn])
    for r in (kv, attn):
        r.build_accelerator_graph_buffers(slots=2, max_bs=4, max_seq_len=64)
    for r in "ab":
        node.ingest_request(r)
    prefill = Step(KVStep((KVSpan("a", "t", 15), KVSpan("b", "t", 11))))  # 4 + 3 pages
    assert node.step(prefill, lambda ctx: None).outcome
    assert kv.num_free_pages == 0
    decode = Step(KVStep((KVSpan("a", "t", 1), KVSpan("b", "t", 1))))  # both fit their last page
    ctx = StepContext(slot=0, bucket=4)
    assert node.admit(decode, ctx)
    node.plan(decode, ctx)  # 7 pages + 2 padding rows: more than the cache's 8 pages
    (entry,) = ctx.plan_results["attn"].entries
    assert entry.kind == "paged_decode" and entry.num_tokens == 4
    q = torch.zeros(4, cfg.qo_heads, cfg.head_dim)
    with node.bound(ctx):
        assert attn.run(q, "t", layer_idx=0).shape == q.shape
    node.rollback_admit(decode, ctx)
