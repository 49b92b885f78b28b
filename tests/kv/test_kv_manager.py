"""Paged KVManager: lifecycle, admission, plan layout, commit, bad input."""

import pytest
import torch

from mstar_core import KVSpan, KVStep, Shortage, StepContext

from ..helpers import run_step, small_kv, step


def test_ingest_is_idempotent():
    kv = small_kv()
    kv.ingest_request("a", {"x": 1})
    run_step(kv, step(("a", "t", 5)))
    kv.ingest_request("a", {"x": 2})  # a second partition's ingest changes nothing
    assert kv.stream("a", "t").length == 5
    assert kv.requests == ("a",)


def test_remove_unknown_request_is_a_noop():
    kv = small_kv()
    kv.remove_request("nobody")
    assert kv.num_free_pages == 8


def test_span_for_request_never_ingested_names_it():
    kv = small_kv()
    kv.ingest_request("a")
    with pytest.raises(KeyError, match=r"'ghost'.*never ingested.*\['a'\]"):
        kv.admit(step(("ghost", "t", 3)), StepContext())


def test_plan_layout_and_flashinfer_arrays():
    kv = small_kv(page_size=4)
    for r in "ab":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 6)))
    plan = run_step(kv, step(("a", "t", 1), ("b", "t", 4)))
    lay = plan.layout("t")
    a, b = lay.spans
    assert (a.length, a.to_compute, a.q_start, a.prefix_len) == (7, 1, 0, 6)
    assert (b.length, b.to_compute, b.q_start) == (4, 4, 1)
    assert lay.qo_indptr.tolist() == [0, 1, 5] and lay.qo_indptr.dtype == torch.int32
    assert lay.kv_indptr.tolist() == [0, 2, 3]
    assert lay.kv_indices.tolist() == list(a.pages) + list(b.pages)
    assert lay.kv_last_page_len.tolist() == [3, 4]
    assert lay.positions.tolist() == [6, 0, 1, 2, 3]
    assert lay.write_pages.tolist() == [a.pages[1]] + [b.pages[0]] * 4
    assert lay.write_offsets.tolist() == [2, 0, 1, 2, 3]
    assert not lay.qo_indptr.is_cuda and lay.kv_indices.device.type == "cpu"


def test_write_kv_lands_where_the_plan_says():
    kv = small_kv(page_size=4)
    kv.ingest_request("a")
    st = step(("a", "t", 6))
    ctx = StepContext()
    kv.admit(st, ctx)
    lay = kv.plan(st, ctx).layout("t")
    k = torch.randn(6, 2, 8, dtype=torch.float64)
    v = torch.randn(6, 2, 8, dtype=torch.float64)
    kv.write_kv(k, v, layer_idx=1, label="t")
    layer = kv.layer_view(1)
    pages = lay.spans[0].pages
    got_k = torch.cat([layer[p, 0] for p in pages])[:6]
    got_v = torch.cat([layer[p, 1] for p in pages])[:6]
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert kv.layer_view(0).abs().sum() == 0  # other layers untouched


def test_write_kv_wrong_shape_names_expected():
    kv = small_kv()
    kv.ingest_request("a")
    st = step(("a", "t", 3))
    ctx = StepContext()
    kv.admit(st, ctx)
    kv.plan(st, ctx)
    with pytest.raises(ValueError, match=r"expected \(3, 2, 8\)"):
        kv.write_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), 0, "t")


def test_refusal_then_rollback_leaves_pool_as_before():
    kv = small_kv(max_pages=4, page_size=4)
    for r in "abc":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 5)))  # 2 pages
    before = (kv.num_free_pages, {k: list(s.pages) for k, s in kv.streams.items()})
    out = kv.admit(step(("b", "t", 4), ("c", "t", 9)), StepContext())  # needs 1 + 3 > 2
    assert not out and "needs 4 pages" in out.reason() and "2 free" in out.reason()
    assert (kv.num_free_pages, {k: list(s.pages) for k, s in kv.streams.items()}) == before
    # admitted by this resource, then rolled back because another resource refused
    ctx = StepContext()
    assert kv.admit(step(("a", "t", 4), ("b", "t", 1)), ctx)
    kv.rollback_admit(step(("a", "t", 4), ("b", "t", 1)), ctx)
    assert (kv.num_free_pages, {k: list(s.pages) for k, s in kv.streams.items()}) == before


def test_commit_false_releases_pages_held_only_for_fresh_tokens():
    kv = small_kv(max_pages=8, page_size=4)
    kv.ingest_request("a")
    run_step(kv, step(("a", "t", 5)))  # 2 pages, committed 5
    plan = run_step(kv, step(("a", "t", 8, False)))  # 13 tokens -> 4 pages during the step
    assert len(plan.layout("t").spans[0].pages) == 4
    s = kv.stream("a", "t")
    assert s.length == 5 and len(s.pages) == 2 and kv.num_free_pages == 6


def test_reset_and_remove_free_pages_and_bump_generation():
    kv = small_kv()
    kv.ingest_request("a")
    run_step(kv, step(("a", "t", 9)))
    g = kv.stream("a", "t").generation
    kv.reset_request("a")
    s = kv.stream("a", "t")
    assert s.length == 0 and s.pages == [] and s.generation > g and kv.num_free_pages == 8
    run_step(kv, step(("a", "t", 2)))  # still ingested: runs again from position 0
    kv.remove_request("a")
    assert kv.num_free_pages == 8 and kv.requests == ()
    kv.ingest_request("b")
    kv.reset_request("b", free=True)
    assert kv.requests == ()


def test_label_none_is_ambiguous_with_two_labels():
    kv = small_kv()
    kv.ingest_request("a")
    plan = run_step(kv, step(("a", "text", 2), ("a", "audio", 3)))
    with pytest.raises(ValueError, match="ambiguous.*'text', 'audio'"):
        plan.layout()
    with pytest.raises(KeyError, match="'video'"):
        plan.layout("video")


def test_duplicate_stream_in_one_step_is_refused():
    with pytest.raises(ValueError, match="more than one span"):
        KVStep((KVSpan("a", "t", 1), KVSpan("a", "t", 2)))


def test_generations_never_repeat_across_recreated_streams():
    kv = small_kv()
    kv.ingest_request("a")
    run_step(kv, step(("a", "t", 3)))
    g1 = kv.stream("a", "t").generation
    kv.remove_request("a")
    kv.ingest_request("a")
    run_step(kv, step(("a", "t", 3)))  # same id, same pages, same length: a new generation
    assert kv.stream("a", "t").generation != g1


def test_fork_copies_pages_and_invalidates_both():
    kv = small_kv(max_pages=6, page_size=4)
    for r in "ab":
        kv.ingest_request(r)
    st = step(("a", "t", 6))
    ctx = StepContext()
    kv.admit(st, ctx)
    kv.plan(st, ctx)
    k = torch.randn(6, 2, 8, dtype=torch.float64)
    kv.write_kv(k, -k, 0, "t")
    kv.commit(st, ctx)
    ga = kv.stream("a", "t").generation
    assert kv.fork("a", "b", "t")
    a, b = kv.stream("a", "t"), kv.stream("b", "t")
    assert b.length == 6 and set(a.pages).isdisjoint(b.pages) and a.generation != ga
    assert torch.equal(kv.layer_view(0)[b.pages], kv.layer_view(0)[a.pages])
    kv.ingest_request("c")
    kv.ingest_request("d")
    assert kv.fork("a", "c", "t")
    out = kv.fork("a", "d", "t")  # 2 more pages needed, 0 free: refused, nothing changed
    assert not out and "needs 2 pages for request 'd', 0 free" in out.reason()
    assert ("d", "t") not in kv.streams
    kv.post_warmup_validate()


def test_refusal_counts_each_request_against_what_earlier_requests_took():
    """A refused admit names every request that does not fit once the requests before it in the
    step (that do fit) have taken their pages: ``available`` is what is left after them, and a
    request that does not fit takes nothing from the later ones."""
    kv = small_kv(max_pages=5, page_size=4)
    for r in "abcd":
        kv.ingest_request(r)
    # a: 2 pages (fits, 3 left), b: 4 (short, 3 left), c: 3 (fits, 0 left), d: 1 (short, 0 left)
    out = kv.admit(step(("a", "t", 8), ("b", "t", 13), ("c", "t", 12), ("d", "t", 1)), StepContext())
    assert not out
    assert out.shortages == (
        Shortage("kv", "pages", 10, 5),
        Shortage("kv", "pages", 4, 3, "b"),
        Shortage("kv", "pages", 1, 0, "d"),
    )
    assert kv.num_free_pages == 5 and not kv.streams


def test_fork_copies_the_pages_of_every_layer():
    """``fork`` gives the destination fresh pages holding the source's K and V in every layer,
    not only the first."""
    kv = small_kv(max_pages=8, page_size=4, layers=3)
    for r in "ab":
        kv.ingest_request(r)
    st = step(("a", "t", 6))
    ctx = StepContext()
    assert kv.admit(st, ctx)
    kv.plan(st, ctx)
    g = torch.Generator().manual_seed(0)
    for layer in range(3):
        k = torch.randn(6, 2, 8, generator=g, dtype=torch.float64)
        kv.write_kv(k, k + 100 * layer, layer, "t")
    kv.commit(st, ctx)
    assert kv.fork("a", "b", "t")
    a, b = kv.stream("a", "t"), kv.stream("b", "t")
    assert set(a.pages).isdisjoint(b.pages)
    for layer in range(3):
        view = kv.layer_view(layer)
        assert view[b.pages].abs().sum() > 0, f"layer {layer}: fork left the destination pages empty"
        assert torch.equal(view[b.pages], view[a.pages]), f"layer {layer} differs after fork"


def test_reset_gives_each_stream_a_generation_it_never_had():
    """``reset_request`` bumps the ``generation`` of every stream of the request (each label),
    to a value no stream of the manager held before: a cache keyed on the old generation can
    never match the reset stream."""
    kv = small_kv(max_pages=8, page_size=4)
    kv.ingest_request("a")
    kv.ingest_request("b")
    run_step(kv, step(("a", "t", 5), ("a", "u", 2), ("b", "t", 3)))
    seen = {s.generation for s in kv.streams.values()}
    before = {k: s.generation for k, s in kv.streams.items()}
    kv.reset_request("a")
    for label in ("t", "u"):
        g = kv.stream("a", label).generation
        assert g not in seen, f"stream ('a', {label!r}) kept or reused generation {g} after the reset"
        seen.add(g)
    assert kv.stream("b", "t").generation == before[("b", "t")]  # another request: untouched


@pytest.mark.parametrize("tokens,want", [(4, 4), (8, 4), (5, 1), (7, 3)])
def test_last_page_len_counts_a_full_last_page_as_page_size(tokens, want):
    """``kv_last_page_len`` is the number of tokens in each row's last page, 1..page_size: a row
    that ends exactly on a page boundary reports ``page_size``, never 0."""
    kv = small_kv(max_pages=8, page_size=4)
    kv.ingest_request("a")
    lay = run_step(kv, step(("a", "t", tokens))).layout("t")
    assert lay.kv_last_page_len.tolist() == [want]
    assert lay.kv_lens.tolist() == [tokens]


def graph_step(kv, rids, bucket, slot=0):
    st = step(*((r, "t", 1) for r in rids))
    ctx = StepContext(slot=slot, bucket=bucket)
    assert kv.admit(st, ctx)
    return st, ctx, kv.plan(st, ctx).layout("t")


def test_graph_padding_rows_write_to_the_sink_page_not_a_stream_page():
    """A graph step padded to its bucket writes its padding rows to the sink page (offset 0),
    never to a page a stream owns — here page 0 belongs to a stream, so the sink page is not 0."""
    kv = small_kv(max_pages=8, page_size=4)
    for r in "ab":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 3)))  # takes page 0 before the sink page is chosen
    kv.build_accelerator_graph_buffers(slots=2, max_bs=4, max_seq_len=64)
    sink = kv.sink_page
    assert sink is not None and sink not in kv.stream("a", "t").pages
    _, _, lay = graph_step(kv, ["a", "b"], bucket=4)
    assert lay.write_pages.numel() == 4
    a_page, b_page = kv.stream("a", "t").pages[0], kv.stream("b", "t").pages[0]
    assert lay.write_pages.tolist() == [a_page, b_page, sink, sink]
    assert lay.write_offsets.tolist() == [3, 0, 0, 0]
    assert lay.positions.tolist() == [3, 0, 0, 0]
    owned = {p for s in kv.streams.values() for p in s.pages}
    assert not set(lay.write_pages[2:].tolist()) & owned


def test_graph_buffers_grow_only_a_smaller_slot_count_keeps_the_slots():
    """``build_accelerator_graph_buffers`` is grow-only: a later call with fewer slots (and more
    rows) keeps every staging slot the first call made, so a graph captured for slot 1 still
    has its buffers."""
    kv = small_kv(max_pages=16, page_size=4)
    kv.build_accelerator_graph_buffers(slots=3, max_bs=2, max_seq_len=64)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    rids = ["a", "b", "c"]
    for r in rids:
        kv.ingest_request(r)
    for slot in (2, 1, 0):
        st, ctx, lay = graph_step(kv, rids, bucket=4, slot=slot)
        assert lay.write_pages.numel() == 4  # the larger max_bs holds a bucket of 4
        kv.rollback_admit(st, ctx)
    kv.post_warmup_validate()
