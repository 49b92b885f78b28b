"""A label's layout: the staged row arrays tile their buffer, counts given per span lay out as the
one count they share would, a row with no tokens has no last page, a plan asking more than its
admit took is refused naming the stream, and a layout built without the page table says so."""

import dataclasses

import numpy as np
import pytest
import torch

from mstar_core import KVPlan, LabelLayout, StepContext
from mstar_core.errors import StateError
from mstar_core.kv.layout import build_layout, row_state
from mstar_core.kv.plan import RowPack

from ..helpers import run_step, small_kv, step
from .test_page_table import check


@pytest.mark.parametrize("at", [0, 5])
@pytest.mark.parametrize("rows", [0, 1, 3])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_a_row_pack_tiles_its_fields_end_to_end(decode, rows, at):
    pack = RowPack(rows, decode, at)
    # two indptrs, four fields every plan stages, then three of a decode step's or two of another's
    assert pack.size == 2 * (rows + 1) + rows * (4 + (3 if decode else 2))
    a = np.arange(at + pack.size + 3)  # entries on either side belong to no field
    fields = [pack.qo(a), pack.kv_indptr(a), pack.last(a), pack.kv_lens(a), pack.num_pages(a), pack.page_base(a)]
    if decode:
        fields += [pack.last_index(a), pack.slots_and_positions(a).reshape(-1)]
    else:
        fields += [pack.pos_base(a), pack.table_base(a)]
    assert np.concatenate(fields).tolist() == list(range(at, at + pack.size))
    assert pack.kv_ends(a).tolist() == pack.kv_indptr(a)[1:].tolist()


def test_a_row_pack_is_a_prefill_one_from_entry_zero_unless_told():
    assert RowPack(3) == RowPack(3, False, 0)


def admitted(kv, *spans):
    """``kv`` with the step of ``spans`` admitted (not planned); returns it and its context."""
    st, ctx = step(*spans), StepContext()
    assert kv.admit(st, ctx)
    return st, ctx


def layout_of(kv, st, counts):
    """build_layout of ``st``'s spans over its admitted streams, with ``counts`` as given."""
    kv.table.prepare()
    streams = [kv.stream(s.request_id, s.label) for s in st.kv.spans]
    return build_layout(kv.table, st.kv.spans, row_state(streams), counts, 4, torch.device("cpu"))


@pytest.mark.parametrize("n", [1, 3])
def test_counts_given_per_span_lay_out_as_the_one_count_they_share(n):
    kv = small_kv(max_pages=16)
    for r in "ab":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 5), ("b", "t", 2)))
    st, _ = admitted(kv, ("a", "t", n), ("b", "t", n))
    one, each = layout_of(kv, st, n), layout_of(kv, st, [n, n])
    assert one.decode == each.decode == (n == 1)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "positions", "write_pages"):
        assert torch.equal(getattr(one, name), getattr(each, name)), name
    check(each)


def test_a_step_of_one_row_and_one_token_is_a_decode_step():
    kv = small_kv()
    kv.ingest_request("a")
    run_step(kv, step(("a", "t", 3)))
    lay = run_step(kv, step(("a", "t", 1))).layout()
    assert lay.decode and lay.positions.tolist() == [3]
    check(lay)


def test_a_layout_of_no_rows_is_not_a_decode_one():
    kv = small_kv()
    for counts in (1, []):
        lay = build_layout(kv.table, [], row_state([]), counts, 4, torch.device("cpu"))
        assert not lay.decode and lay.num_tokens == 0 and lay.kv_indptr.tolist() == [0]
        assert lay.kv_indices.tolist() == []


def test_a_row_with_no_tokens_has_no_pages_and_no_last_page():
    kv = small_kv()
    for r in "ab":
        kv.ingest_request(r)
    lay = run_step(kv, step(("a", "t", 0), ("b", "t", 6))).layout()
    assert lay.kv_lens.tolist() == [0, 6]
    assert lay.kv_indptr.tolist() == [0, 0, 2]
    assert lay.kv_last_page_len.tolist() == [0, 2]


def test_a_plan_asking_more_than_its_admit_took_names_the_first_stream_short_of_pages():
    kv = small_kv()
    for r in "abc":
        kv.ingest_request(r)
    _, ctx = admitted(kv, ("a", "t", 4), ("b", "t", 4), ("c", "t", 4))  # a page each
    # a needs exactly the page it holds, b and c one more
    with pytest.raises(StateError, match=r"plan before admit: stream \('b', 't'\) needs 2 pages, holds 1"):
        kv.plan(step(("a", "t", 4), ("b", "t", 5), ("c", "t", 8)), ctx)


def planned(kv):
    for r in "ab":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 2)))
    return run_step(kv, step(("a", "t", 3), ("b", "t", 2))).layout("t")


@pytest.mark.parametrize("missing", ["table", "rows_device", "pack"])
def test_a_layout_without_what_its_per_token_arrays_come_from_says_so(missing):
    lay = planned(small_kv())
    bare = dataclasses.replace(lay, per_token={}, **{missing: None})
    for name in ("write_pages", "write_offsets", "positions"):
        with pytest.raises(StateError, match="this layout has no per-token arrays"):
            getattr(bare, name)
    assert lay.positions.tolist() == [2, 3, 4, 0, 1]  # the layout it was copied from has them


def test_a_copy_of_a_layout_with_other_rows_reads_its_own_spans():
    kv = small_kv()
    lay = planned(kv)
    assert [s.request_id for s in lay.spans] == ["a", "b"]  # read once: kept with the layout
    other = run_step(kv, step(("b", "t", 1))).layout()
    assert dataclasses.replace(lay, rows=other.rows).spans == other.spans


def test_a_layout_built_by_hand_is_of_no_tokens_not_decode_and_without_per_token_arrays():
    lay = planned(small_kv())
    bare = LabelLayout(lay.rows, lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len, lay.kv_lens,
                       lay.page_size, lay.device)
    assert (bare.num_tokens, bare.decode, bare.table, bare.rows_device, bare.pack) == (0, False, None, None, None)
    with pytest.raises(StateError, match="no per-token arrays"):
        bare.write_pages  # noqa: B018


def test_a_layout_prints_its_host_arrays_not_the_table_or_the_staged_buffers():
    # a plan in a log line or a failed assert: what a backend plans from, not what it was built from
    lay = planned(small_kv())
    lay.spans, lay.positions  # noqa: B018  # the lazy parts built, so there is something to hide
    text = repr(lay)
    for shown in ("qo_indptr=", "kv_indptr=", "kv_indices=", "kv_last_page_len=", "kv_lens=", "page_size=4",
                  "num_tokens=5", "decode=False"):
        assert shown in text
    for hidden in ("rows=", "per_token=", "table=", "rows_device=", "pack=", "_built=", "SpanRows", "RowPack"):
        assert hidden not in text


def test_a_plan_of_one_label_gives_its_layout_without_the_label_named():
    kv = small_kv()
    kv.ingest_request("a")
    plan = run_step(kv, step(("a", "t", 3)))
    assert isinstance(plan, KVPlan) and plan.layout() is plan.layout("t")
