"""Paged KVManager state a caller sees between and after steps: cleanup forgets everything, a
commit or plan must match its context's admit, dead plans are never current, layer indices and
page accounting are checked, and ``write_kv`` takes its label through the compiled op."""

import pytest
import torch

from mstar_core import KVConfig, KVManager, StepContext
from mstar_core.errors import InputError, InputIndexError, StateError, UnknownName

from ..helpers import run_step, small_kv, step


def prefix_kv(max_pages=8, ps=4) -> KVManager:
    return KVManager(KVConfig(2, 1, 4, ps, max_pages, 1), "cpu", torch.float32, prefix_cache=True)


def test_cleanup_forgets_every_stream_request_plan_and_page():
    kv = small_kv(requests=["a", "b"])
    run_step(kv, step(("a", "t", 5)))
    s, ctx = step(("b", "t", 3)), StepContext()
    assert kv.admit(s, ctx)
    plan = kv.plan(s, ctx)
    kv.reset_request("b")  # its pages parked while the step is in flight
    kv.cleanup()
    assert (kv.requests, len(kv.streams), kv.num_free_pages, kv.storage.numel()) == ((), 0, 8, 0)
    assert not kv.is_live(plan)
    with pytest.raises(UnknownName, match=r"no stream \('a', 't'\); known streams: \[\]"):
        kv.stream("a", "t")
    with pytest.raises(StateError, match=r"no step is planned"):
        kv.current  # noqa: B018
    kv.post_warmup_validate()  # the parked pages are forgotten with the pool they came from


def test_after_cleanup_the_page_table_starts_from_its_first_row():
    kv = small_kv(requests=["a", "b"])
    run_step(kv, step(("a", "t", 5), ("b", "t", 1)))
    kv.cleanup()
    kv.ingest_request("c")
    run_step(kv, step(("c", "t", 1)))
    assert kv.stream("c", "t").table_row == 0


def test_after_cleanup_graph_padding_goes_to_the_new_sink_page():
    kv = small_kv(max_pages=8, page_size=4)
    kv.ingest_request("a")
    run_step(kv, step(("a", "t", 5)))  # pages 0 and 1: the sink page is another
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    old = kv.sink_page
    s, ctx = step(("a", "t", 1)), StepContext(bucket=4)
    assert kv.admit(s, ctx)
    kv.plan(s, ctx)
    kv.cleanup()
    assert kv.sink_page is None
    kv.ingest_request("a")
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    assert kv.sink_page != old
    s, ctx = step(("a", "t", 1)), StepContext(bucket=4)
    assert kv.admit(s, ctx)
    lay = kv.plan(s, ctx).layout("t")
    assert lay.write_pages.tolist()[1:] == [kv.sink_page] * 3


def test_after_cleanup_a_match_made_before_it_finds_nothing():
    kv = prefix_kv()
    ids, other = list(range(9)), list(range(100, 109))
    kv.ingest_request("p")
    assert kv.admit_prefix("p", "t", ids, b"m")
    run_step(kv, step(("p", "t", 9)))
    assert kv.match_prefix(ids, b"m", "t") == 8
    kv.cleanup()
    kv.ingest_request("q")  # the same number of pages published again, of other tokens
    assert kv.admit_prefix("q", "t", other, b"m")
    run_step(kv, step(("q", "t", 9)))
    kv.ingest_request("r")
    assert kv.admit_prefix("r", "t", ids, b"m").cached_tokens == 0


def test_a_commit_of_streams_another_step_admitted_is_refused():
    kv = small_kv(requests=["a", "b"])
    ctx = StepContext()
    assert kv.admit(step(("a", "t", 1)), ctx)
    with pytest.raises(StateError, match=r"commit of streams \[\('b', 't'\)\] that this StepContext has no live admit"):
        kv.commit(step(("b", "t", 1)), ctx)
    with pytest.raises(StateError, match=r"plan of streams \[\('b', 't'\)\]"):
        kv.plan(step(("a", "t", 1), ("b", "t", 1)), ctx)


def test_a_plan_of_some_of_the_admitted_streams_lays_out_those():
    kv = small_kv(requests=["a", "b"])
    run_step(kv, step(("a", "t", 2), ("b", "t", 3)))
    s, ctx = step(("a", "t", 1), ("b", "t", 1)), StepContext()
    assert kv.admit(s, ctx)
    lay = kv.plan(step(("b", "t", 1)), ctx).layout("t")
    assert [(x.request_id, x.prefix_len) for x in lay.spans] == [("b", 3)]
    assert lay.write_pages.tolist() == [kv.stream("b", "t").pages[0]]
    kv.rollback_admit(s, ctx)


def test_a_plan_after_its_stream_was_reset_is_refused():
    kv = small_kv(requests=["a"])
    s, ctx = step(("a", "t", 2)), StepContext()
    assert kv.admit(s, ctx)
    kv.reset_request("a")
    with pytest.raises(StateError, match=r"plan: stream \('a', 't'\) was reset or removed after this step's admit"):
        kv.plan(s, ctx)


def test_each_label_lays_out_only_its_own_spans():
    kv = small_kv(max_pages=16)
    for r in "ab":
        kv.ingest_request(r)
    plan = run_step(kv, step(("a", "t", 3), ("a", "u", 2), ("b", "t", 1)))
    assert [x.request_id for x in plan.layout("t").spans] == ["a", "b"]
    assert [x.request_id for x in plan.layout("u").spans] == ["a"]
    assert plan.layout("u").positions.tolist() == [0, 1]


def test_a_commit_before_any_plan_is_refused():
    kv = small_kv(requests=["a"])
    s, ctx = step(("a", "t", 2)), StepContext()
    assert kv.admit(s, ctx)
    with pytest.raises(StateError, match=r"admitted but never planned"):
        kv.commit(s, ctx)


def test_no_plan_is_current_before_the_first_or_after_its_commit():
    kv = small_kv(requests=["a"])
    with pytest.raises(StateError, match=r"no step is planned"):
        kv.current  # noqa: B018
    s, ctx = step(("a", "t", 2)), StepContext()
    assert kv.admit(s, ctx)
    plan = kv.plan(s, ctx)
    kv.commit(s, ctx)
    assert not kv.is_live(plan)
    with pytest.raises(StateError, match=r"no step is planned"):
        kv.current  # noqa: B018
    kv.enter_plan(plan)  # a forward bound to a committed step's plan may not write through it
    with pytest.raises(StateError, match=r"no step is planned"):
        kv.current  # noqa: B018
    kv.exit_plan()


@pytest.mark.parametrize("bad", [2, -1, 1.0, True, "0"])
def test_a_layer_index_outside_the_cache_is_refused(bad):
    kv = small_kv(layers=2)
    with pytest.raises(InputIndexError, match=r"layer_idx .* out of range: this cache holds layers 0\.\.1"):
        kv.layer_view(bad)


def test_a_cache_of_the_model_dtype_has_no_scales():
    assert small_kv().scales(1) == (None, None)


def test_store_writes_the_cache_by_default():
    kv = small_kv()
    k = torch.arange(2 * 2 * 8, dtype=torch.float64).reshape(2, 2, 8)
    kv.store(1, torch.tensor([3, 5]), torch.tensor([0, 2]), k, -k)
    layer = kv.layer_view(1)
    assert torch.equal(layer[3, 0, 0], k[0]) and torch.equal(layer[5, 1, 2], -k[1])


@pytest.mark.parametrize("label", ["u", None])
def test_write_kv_passes_its_label_to_the_compiled_op(monkeypatch, label):
    kv = small_kv(requests=["a"])
    spans = [("a", "t", 2), ("a", "u", 3)] if label else [("a", "u", 3)]
    s, ctx = step(*spans), StepContext()
    assert kv.admit(s, ctx)
    lay = kv.plan(s, ctx).layout("u")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    k = torch.randn(3, 2, 8, dtype=torch.float64)
    kv.write_kv(k, -k, 0, label)
    assert torch.equal(kv.layer_view(0)[lay.write_pages, 0, lay.write_offsets], k)


def two_streams() -> KVManager:
    kv = small_kv(requests=["a", "b"])
    run_step(kv, step(("a", "t", 5), ("b", "t", 1)))
    kv.post_warmup_validate()
    return kv


def test_validate_finds_a_page_held_twice():
    kv = two_streams()
    b = kv.stream("b", "t")
    b.pages = [*b.pages, kv.stream("a", "t").pages[0]]
    with pytest.raises(StateError, match=r"page accounting broken: 4 owned by streams \(3 distinct\), 3 marked used"):
        kv.post_warmup_validate()


def test_validate_finds_a_page_used_but_held_by_no_stream():
    kv = two_streams()
    kv.pool.take(1)
    with pytest.raises(StateError, match=r"page accounting broken: 3 owned by streams \(3 distinct\), 4 marked used"):
        kv.post_warmup_validate()


def test_validate_finds_a_stream_longer_than_its_pages():
    kv = two_streams()
    kv.stream("b", "t").length = 5
    with pytest.raises(StateError, match=r"fewer pages than their length needs .*: \{\('b', 't'\): \(1, 5\)\}"):
        kv.post_warmup_validate()


def test_a_span_of_an_unknown_request_is_refused_whatever_its_label():
    kv = small_kv()
    kv.ingest_request("t")  # a request named like the label
    with pytest.raises(UnknownName, match=r"'ghost'.*never ingested"):
        kv.admit(step(("ghost", "t", 3)), StepContext())


def test_a_commit_of_a_step_without_spans_and_without_an_admit_is_refused():
    kv = small_kv()
    with pytest.raises(StateError, match=r"no live admit"):
        kv.commit(step(), StepContext())


def test_steps_of_uneven_rows_over_the_same_streams_look_them_up_once(monkeypatch):
    kv = small_kv(max_pages=16)
    for r in "ab":
        kv.ingest_request(r)
    uneven = step(("a", "t", 1), ("b", "t", 2))
    for _ in range(2):
        run_step(kv, uneven)  # the first creates the streams, the second looks them up
    calls, real = [], kv.streams.get
    monkeypatch.setattr(kv.streams, "get", lambda key, default=None: calls.append(key) or real(key, default))
    for _ in range(3):
        run_step(kv, step(("a", "t", 1), ("b", "t", 2)))
    assert calls == [] and (kv.stream("a", "t").length, kv.stream("b", "t").length) == (5, 10)


def test_a_rollback_refuses_a_stream_whose_step_pages_moved_since_the_admit():
    kv = small_kv(requests=["a"])
    run_step(kv, step(("a", "t", 3)))
    s, ctx = step(("a", "t", 6)), StepContext()
    assert kv.admit(s, ctx)
    st = kv.stream("a", "t")
    st.pages = [st.pages[0], st.pages[2], st.pages[1]]  # the step's two pages, reordered
    with pytest.raises(StateError, match=r"stream \('a', 't'\): pages changed between admit and rollback"):
        kv.rollback_admit(s, ctx)


def test_a_layer_of_the_buffer_past_the_cache_is_not_one_of_its_layers():
    kv = small_kv(layers=2)
    base = torch.zeros((3, *kv.storage.shape[1:]), dtype=kv.storage.dtype)
    kv.storage = base[:2]  # the cache's layers are the first two of a larger buffer
    kv.check_layer_view(base[1], 1, "run")
    with pytest.raises(InputError, match=r"is not a layer of this KV cache; pass layer_view\(1\) with layer_idx=1"):
        kv.check_layer_view(base[2], 1, "run")
