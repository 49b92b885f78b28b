"""Graph steps of the paged KVManager: the per-token arrays staged into a slot's static buffers
(on the host's numpy path and on the accelerator's torch path), padding to the sink page, the
buffers' growth and address stability, and the checks that refuse a graph step that cannot fit."""

import pytest
import torch

from mstar_core import AttentionFeatures, KVConfig, KVManager, StepContext
from mstar_core.errors import InputError, StateError

from ..helpers import run_step, small_kv, step


def graph_kv(on_host: bool, max_pages=16) -> KVManager:
    kv = small_kv(max_pages=max_pages, page_size=4)
    kv.table.on_host = on_host  # False: the accelerator's torch path, run on the CPU
    return kv


def expected(kv: KVManager, spans, padded: int) -> list[list[int]]:
    """Pages, offsets and positions of each span's new tokens (from the host page lists), then
    padding rows at the sink page, offset 0, position 0."""
    ps = kv.config.page_size
    pages, offsets, positions = [], [], []
    for rid, label, n in spans:
        st = kv.stream(rid, label)
        for pos in range(st.length, st.length + n):
            pages.append(st.pages[pos // ps])
            offsets.append(pos % ps)
            positions.append(pos)
    pad = padded - len(pages)
    return [pages + [kv.sink_page] * pad, offsets + [0] * pad, positions + [0] * pad]


def staged(lay) -> list[list[int]]:
    return [lay.write_pages.tolist(), lay.write_offsets.tolist(), lay.positions.tolist()]


def graph_plan(kv: KVManager, spans, bucket: int, slot=0, query_tokens=1):
    st, ctx = step(*spans), StepContext(slot=slot, bucket=bucket, query_tokens=query_tokens)
    assert kv.admit(st, ctx)
    return st, ctx, kv.plan(st, ctx).layout("t")


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("n", [1, 2])  # a decode step, and a step of two tokens per row
def test_a_graph_step_stages_its_tokens_then_padding_to_the_sink_page(on_host, n):
    kv = graph_kv(on_host)
    for r in "abcd":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 3), ("b", "t", 6)))
    kv.build_accelerator_graph_buffers(slots=2, max_bs=8, max_seq_len=64)
    # a full slot first: the padded step after it must overwrite what that step left there
    full = [("a", "t", n), ("b", "t", n), ("c", "t", n), ("d", "t", n)]
    st, ctx, lay = graph_plan(kv, full, bucket=4, slot=1, query_tokens=n)
    assert staged(lay) == expected(kv, full, 4 * n)
    kv.commit(st, ctx)
    spans = [("a", "t", n), ("c", "t", n)]
    st, ctx, lay = graph_plan(kv, spans, bucket=4, slot=1, query_tokens=n)
    assert staged(lay) == expected(kv, spans, 4 * n)
    kv.commit(st, ctx)


def test_a_graph_step_of_uneven_rows_is_staged():
    kv = graph_kv(True)
    for r in "ab":
        kv.ingest_request(r)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=8, max_seq_len=64)
    spans = [("a", "t", 1), ("b", "t", 2)]
    _, _, lay = graph_plan(kv, spans, bucket=4)
    assert staged(lay) == expected(kv, spans, 4)


def test_a_graph_step_before_the_buffers_are_built_is_refused():
    kv = graph_kv(True)
    kv.ingest_request("a")
    with pytest.raises(StateError, match=r"a graph step needs build_accelerator_graph_buffers first"):
        graph_plan(kv, [("a", "t", 1)], bucket=2)


@pytest.mark.parametrize("rows,bucket", [(3, 2), (1, 8)])  # more tokens than the bucket; a bucket past the buffers
def test_a_graph_step_that_does_not_fit_is_refused(rows, bucket):
    kv = graph_kv(True)
    rids = "abc"[:rows]
    for r in rids:
        kv.ingest_request(r)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    with pytest.raises(InputError, match=rf"graph step: {rows} tokens padded to {bucket}; static buffers hold 4"):
        graph_plan(kv, [(r, "t", 1) for r in rids], bucket=bucket)


def test_a_graph_step_has_one_label():
    kv = graph_kv(True)
    kv.ingest_request("a")
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    st, ctx = step(("a", "t", 1), ("a", "u", 1)), StepContext(bucket=2)
    assert kv.admit(st, ctx)
    with pytest.raises(InputError, match=r"a graph step \(bucket 2\) has one label; this one has \['t', 'u'\]"):
        kv.plan(st, ctx)


def test_the_buffers_hold_the_query_tokens_of_every_decode_row():
    feats = AttentionFeatures(decode_query_tokens=3)
    kv = KVManager(KVConfig(2, 2, 8, 4, 16, 4), "cpu", torch.float64, features=feats)
    for r in "ab":
        kv.ingest_request(r)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=2, max_seq_len=64)
    spans = [("a", "t", 3), ("b", "t", 3)]
    st, ctx = step(*spans), StepContext(bucket=2, query_tokens=3)
    assert kv.admit(st, ctx)
    assert staged(kv.plan(st, ctx).layout("t")) == expected(kv, spans, 6)


def test_the_sink_page_takes_the_last_free_page_and_none_is_refused():
    kv = small_kv(max_pages=2, page_size=4)
    kv.ingest_request("a")
    run_step(kv, step(("a", "t", 3)))
    kv.build_accelerator_graph_buffers(slots=1, max_bs=2, max_seq_len=64)
    assert kv.num_free_pages == 0 and kv.sink_page not in kv.stream("a", "t").pages
    full = small_kv(max_pages=1, page_size=4)
    full.ingest_request("a")
    run_step(full, step(("a", "t", 3)))
    with pytest.raises(StateError, match=r"no free page left for the sink page"):
        full.build_accelerator_graph_buffers(slots=1, max_bs=2, max_seq_len=64)


def test_more_slots_asked_later_are_built():
    kv = graph_kv(True)
    for r in "ab":
        kv.ingest_request(r)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    kv.build_accelerator_graph_buffers(slots=3, max_bs=4, max_seq_len=64)
    _, _, lay = graph_plan(kv, [("a", "t", 1), ("b", "t", 1)], bucket=4, slot=2)
    assert staged(lay) == expected(kv, [("a", "t", 1), ("b", "t", 1)], 4)


def test_a_larger_row_count_keeps_the_slot_count():
    kv = graph_kv(True)
    kv.ingest_request("a")
    kv.build_accelerator_graph_buffers(slots=1, max_bs=2, max_seq_len=64)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    with pytest.raises(IndexError):
        graph_plan(kv, [("a", "t", 1)], bucket=4, slot=1)


def test_the_same_buffers_serve_until_a_larger_call_moves_them():
    kv = graph_kv(True)
    for r in "ab":
        kv.ingest_request(r)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    st, ctx, first = graph_plan(kv, [("a", "t", 1)], bucket=4)
    kv.rollback_admit(st, ctx)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)  # the same size: nothing moves
    st, ctx, again = graph_plan(kv, [("a", "t", 1)], bucket=4)
    assert again.write_pages.data_ptr() == first.write_pages.data_ptr()
    kv.rollback_admit(st, ctx)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=8, max_seq_len=64)  # larger: new buffers
    st, ctx, moved = graph_plan(kv, [("a", "t", 1)], bucket=4)
    kv.rollback_admit(st, ctx)
    _, _, other = graph_plan(kv, [("a", "t", 1), ("b", "t", 1)], bucket=4)
    # every shape of step reads the same (new) buffers, which a graph captured now reads too
    assert moved.write_pages.data_ptr() == other.write_pages.data_ptr() != first.write_pages.data_ptr()


def test_the_manager_captures_and_preplans():
    kv = small_kv()
    assert kv.can_capture() is True and kv.supports_preplan is True


def test_buffers_built_for_no_rows_or_no_slots_hold_no_graph_step():
    kv = graph_kv(True)
    kv.ingest_request("a")
    kv.build_accelerator_graph_buffers(slots=1, max_bs=0, max_seq_len=64)
    with pytest.raises(InputError, match=r"static buffers hold 0"):
        graph_plan(kv, [("a", "t", 1)], bucket=1)
    none = graph_kv(True)
    none.ingest_request("a")
    none.build_accelerator_graph_buffers(slots=0, max_bs=2, max_seq_len=64)
    with pytest.raises(IndexError):
        graph_plan(none, [("a", "t", 1)], bucket=2)
