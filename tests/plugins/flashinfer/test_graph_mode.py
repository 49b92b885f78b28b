"""CUDA-graph mode on CPU through the stand-in: static buffers handed to FlashInfer once, updated
in place by every plan, overflow refused by name, per-slot staging."""

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


def _prefill(batch=4, tokens=64, pages=48):
    return FlashInferPrefillWrapper(WS, 4, 2, 16, 4, batch_size=batch, max_total_tokens=tokens, max_num_pages=pages,
                                    device=torch.device("cpu"), accelerator_graph=True)


def _ptrs(w):
    inner = w._inner
    return [inner._qo_indptr_buf.data_ptr(), inner._paged_kv_indptr_buf.data_ptr(),
            inner._paged_kv_indices_buf.data_ptr(), inner._paged_kv_last_page_len_buf.data_ptr()]


def test_prefill_static_buffers_are_flashinfers_and_survive_replans():
    w = _prefill()
    assert w._inner.is_cuda_graph_enabled
    assert w._inner._qo_indptr_buf is w._bufs["qo_indptr"]
    before = _ptrs(w)
    for i, (q, p) in enumerate([((3, 1, 5, 2), (4, 9, 0, 7)), ((1, 6), (11, 2)), ((2, 2, 2, 2), (0, 1, 2, 3))]):
        c = case(q, p, seed=i)
        d = C.make_paged(c, "cpu", F32)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_lens=d.kv_lens)
        assert _ptrs(w) == before
        assert err(w.run(d.q, d.layer), oracle(c, d)) < 2e-5
        # the static-shape call a captured graph makes: max_total_tokens rows, the planned ones exact
        q_static = torch.cat([d.q, torch.randn(64 - d.q.shape[0], *d.q.shape[1:])])
        out = w.run(q_static, d.layer)
        assert out.shape[0] == 64 and err(out[: d.q.shape[0]], oracle(c, d)) < 2e-5


def test_prefill_rows_padded_to_batch_size_with_empty_rows():
    w = _prefill()
    c = case((5,), (3,))
    d = C.make_paged(c, "cpu", F32)
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    qo = w._bufs["qo_indptr"].tolist()
    assert qo == [0, 5, 5, 5, 5]  # three padding rows, no queries
    assert w._bufs["last_page_len"].tolist()[1:] == [1, 1, 1]


@pytest.mark.parametrize("what,q,p,match", [
    ("rows", (1,) * 5, (1,) * 5, "5 rows exceed batch_size=4"),
    ("tokens", (40, 30), (0, 0), "70 tokens exceed max_total_tokens=64"),
    ("pages", (8, 8), (90, 90), r"pages .* exceed max_num_pages=48"),
])
def test_prefill_overflow_is_refused_by_name(what, q, p, match):
    w = _prefill()
    d = C.make_paged(case(q, p), "cpu", F32)
    with pytest.raises(ValueError, match=match):
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)


def test_graph_mode_needs_its_sizes():
    with pytest.raises(ValueError, match="batch_size is required"):
        FlashInferPrefillWrapper(WS, 4, 2, 16, 4, device=torch.device("cpu"), accelerator_graph=True)
    with pytest.raises(ValueError, match="max_total_tokens is required"):
        FlashInferPrefillWrapper(WS, 4, 2, 16, 4, batch_size=2, max_num_pages=8, device=torch.device("cpu"),
                                 accelerator_graph=True)
    with pytest.raises(ValueError, match="max_num_pages is required"):
        FlashInferDecodeWrapper(WS, 4, 2, 16, 4, batch_size=2, device=torch.device("cpu"), accelerator_graph=True)


@pytest.mark.parametrize("gqa", [1, 4], ids=["cuda-cores", "tensor-cores"])
def test_decode_graph_replans_in_place_and_pads(gqa):
    w = FlashInferDecodeWrapper(WS, 2 * gqa, 2, 16, 4, batch_size=6, max_num_pages=40, device=torch.device("cpu"),
                                accelerator_graph=True)
    assert w.use_tensor_cores == (gqa >= 4)
    ptrs = [w._inner._paged_kv_indptr_buf.data_ptr(), w._inner._paged_kv_indices_buf.data_ptr()]
    for i, rows in enumerate([6, 3, 5]):
        c = case((1,) * rows, tuple(range(rows * 3, 0, -3))[:rows], gqa=gqa, seed=i)
        d = C.make_paged(c, "cpu", F32)
        w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_lens=d.kv_lens)
        q = torch.cat([d.q, torch.randn(6 - rows, *d.q.shape[1:])])  # the captured shape: batch_size rows
        out = w.run(q, d.layer)
        assert err(out[:rows], oracle(c, d)) < 2e-5
        assert [w._inner._paged_kv_indptr_buf.data_ptr(), w._inner._paged_kv_indices_buf.data_ptr()] == ptrs
        if rows < 6:
            with pytest.raises(ValueError, match="expected 6 \\(static\\)"):
                w.run(d.q, d.layer)  # the kernel reads all batch_size rows of q


def test_decode_overflow_is_refused_by_name():
    w = FlashInferDecodeWrapper(WS, 4, 2, 16, 4, batch_size=2, max_num_pages=4, device=torch.device("cpu"),
                                accelerator_graph=True)
    d = C.make_paged(case((1, 1, 1), (3, 3, 3)), "cpu", F32)
    with pytest.raises(ValueError, match="3 rows exceed batch_size=2"):
        w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    d = C.make_paged(case((1, 1), (9, 9)), "cpu", F32)
    with pytest.raises(ValueError, match="exceed max_num_pages=4"):
        w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)


def test_per_slot_staging_keeps_the_previous_plans_arrays():
    """Plan N+1 stages into the other slot, so the host buffer plan N's async copy reads from is
    untouched while that copy may still be in flight."""
    w = _prefill()
    staged = []
    for i, (q, p) in enumerate([((2, 3), (1, 4)), ((4, 1, 1), (0, 8, 2)), ((1,), (30,))]):
        d = C.make_paged(case(q, p, seed=i), "cpu", F32)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
        slot = w._staging.slot
        n = d.kv_indptr.numel()
        # one buffer per slot holds the plan's row arrays: qo_indptr (padded to batch + 1), then kv_indptr
        assert w._staging.buffer(slot, "rows")[5: 5 + n].tolist() == d.kv_indptr.tolist()
        staged.append((slot, d.kv_indptr.tolist()))
        if i == 1:
            # plan 2 went to slot 1 and left slot 0 -- plan 1's copy source -- exactly as it was
            s0, want = staged[0]
            assert s0 == 0 and w._staging.buffer(0, "rows")[5: 5 + len(want)].tolist() == want
    assert [s for s, _ in staged] == [0, 1, 0]


def test_a_plan_refused_by_our_checks_leaves_the_previous_plan_whole():
    """A refused plan leaves nothing of itself behind: the token count and write locations are
    still those of the previous plan, which FlashInfer still holds."""
    w = _prefill(batch=2, tokens=8, pages=8)
    d = C.make_paged(case((3, 2), (2, 0)), "cpu", F32)
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    before = w.kv_write_locations()
    big = C.make_paged(case((9,), (0,)), "cpu", F32)
    with pytest.raises(ValueError, match="max_total_tokens=8"):
        w.plan(big.qo_indptr, big.kv_indptr, big.kv_indices, big.last_page_len, dtype=F32)
    assert w.planned_tokens == 5
    after = w.kv_write_locations()
    assert torch.equal(after.pages, before.pages) and torch.equal(after.offsets, before.offsets)
    assert err(w.run(d.q, d.layer), oracle(case((3, 2), (2, 0)), d)) < 2e-5


def test_eager_plans_then_run_and_write_locations():
    w = FlashInferPrefillWrapper(WS, 4, 2, 16, 4, device=torch.device("cpu"))
    c = case((3, 1), (5, 2))
    d = C.make_paged(c, "cpu", F32)
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    pages, offs = w.kv_write_locations()
    idx = d.kv_indices.tolist()
    # row 0: positions 5, 6, 7 (its pages idx[0:2]); row 1: position 2 (its page idx[2])
    assert pages.tolist() == [idx[1], idx[1], idx[1], idx[2]]
    assert offs.tolist() == [1, 2, 3, 2]
    with pytest.raises(ValueError, match="q has 7 rows, expected 4"):
        w.run(torch.randn(7, 4, 16), d.layer)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['bogus'\\]"):
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, bogus=1)


def test_decode_write_locations_are_the_last_slot():
    w = FlashInferDecodeWrapper(WS, 4, 2, 16, 4, device=torch.device("cpu"))
    d = C.make_paged(case((1, 1), (3, 4)), "cpu", F32)
    w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    pages, offs = w.kv_write_locations()
    idx, ptr = d.kv_indices.tolist(), d.kv_indptr.tolist()
    assert pages.tolist() == [idx[ptr[1] - 1], idx[ptr[2] - 1]]
    assert offs.tolist() == [(d.last_page_len - 1).tolist()[0], (d.last_page_len - 1).tolist()[1]]


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
