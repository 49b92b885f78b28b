"""Paged KVManager: lifecycle, admission, plan layout, commit, bad input."""

import pytest
import torch

from mstar_core import KVSpan, KVStep, Step, StepContext

from ..helpers import small_kv


def step(*spans):
    return Step(KVStep(tuple(KVSpan(*s) for s in spans)))


def run_step(kv, st):
    ctx = StepContext()
    assert kv.admit(st, ctx)
    plan = kv.plan(st, ctx)
    kv.commit(st, ctx)
    return plan


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
