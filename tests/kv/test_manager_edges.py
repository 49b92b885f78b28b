"""Paged KVManager edges a caller sees: build checks, fork and stream bookkeeping, one admit per
context and per stream, an admit interrupted midway gives everything back, rollback frees what it
created, the latest live plan stays current, token-id checks and a match's answer reused by the
admit that follows it (under the same root only)."""

import numpy as np
import pytest
import torch

from mstar_core import AttentionFeatures, KVConfig, KVManager, StepContext, ops
from mstar_core.errors import InputError, InputTypeError, StateError, UnknownName
from mstar_core.kv.prefix import PrefixCache

from ..helpers import run_step, small_kv, step


def prefix_kv(max_pages=8, ps=4) -> KVManager:
    return KVManager(KVConfig(2, 1, 4, ps, max_pages, 1), "cpu", torch.float32, prefix_cache=True)


def test_build_refuses_features_of_the_wrong_type():
    with pytest.raises(InputTypeError, match=r"features must be an AttentionFeatures, got dict"):
        KVManager(KVConfig(2, 1, 4, 4, 8, 1), features={})  # type: ignore[arg-type]


def test_build_refuses_per_layer_features_for_another_layer_count():
    with pytest.raises(InputError, match=r"layer_windows has 3 entries, the model 2 layers"):
        KVManager(KVConfig(2, 1, 4, 4, 8, 1), features=AttentionFeatures(layer_windows=(-1, 4, -1)))


def test_the_manager_keeps_its_name_and_is_found_by_its_op_handle():
    kv = KVManager(KVConfig(2, 1, 4, 4, 8, 1), name="cache7")
    assert kv.name == "cache7"
    assert ops.resolve(kv.op_handle) is kv


def test_a_removed_stream_gives_its_table_row_back():
    kv = small_kv(requests=["a"])
    run_step(kv, step(("a", "t", 5)))
    old = kv.stream("a", "t")
    assert old.table_row >= 0
    kv.reset_request("a")
    assert old.table_row == -1
    assert kv.num_free_pages == 8


def test_fork_into_a_request_never_ingested_names_it():
    kv = small_kv(requests=["a"])
    run_step(kv, step(("a", "t", 5)))
    with pytest.raises(UnknownName, match=r"fork into request 'ghost', which was never ingested; ingested: \['a'\]"):
        kv.fork("a", "ghost", "t")
    assert ("ghost", "t") not in kv.streams


def test_one_admitted_step_per_context():
    kv = small_kv(requests=["a", "b"])
    ctx = StepContext()
    assert kv.admit(step(("a", "t", 1)), ctx)
    with pytest.raises(StateError, match=r"already holds an admitted step; one step per context"):
        kv.admit(step(("b", "t", 1)), ctx)


def test_a_stream_with_a_step_in_flight_refuses_another_admit():
    kv = small_kv(requests=["a"])
    assert kv.admit(step(("a", "t", 2)), StepContext())
    with pytest.raises(StateError, match=r"already have an admitted step"):
        kv.admit(step(("a", "t", 1)), StepContext())


def test_a_step_naming_one_request_never_ingested_among_known_ones_is_refused():
    kv = small_kv(requests=["a"])
    with pytest.raises(UnknownName, match=r"'ghost'.*never ingested"):
        kv.admit(step(("a", "t", 3), ("ghost", "t", 3)), StepContext())
    assert ("ghost", "t") not in kv.streams


def test_commit_without_an_admit_is_refused():
    kv = small_kv(requests=["a"])
    with pytest.raises(StateError, match=r"no live admit"):
        kv.commit(step(("a", "t", 1)), StepContext())


def test_rollback_of_a_new_stream_forgets_it_and_frees_its_table_row():
    kv = small_kv(requests=["a"])
    s, ctx = step(("a", "t", 5)), StepContext()
    assert kv.admit(s, ctx)
    st = kv.stream("a", "t")
    kv.rollback_admit(s, ctx)
    assert ("a", "t") not in kv.streams
    assert st.table_row == -1
    assert kv.num_free_pages == 8


def test_a_rolled_back_step_leaves_its_stream_free_for_the_next():
    kv = small_kv(requests=["a"])
    run_step(kv, step(("a", "t", 3)))
    s, ctx = step(("a", "t", 2)), StepContext()
    assert kv.admit(s, ctx)
    kv.rollback_admit(s, ctx)
    assert not kv.stream("a", "t").in_flight
    run_step(kv, step(("a", "t", 2)))
    assert kv.stream("a", "t").length == 5


def test_a_stream_reset_with_a_step_in_flight_is_done_with_it_when_the_step_lands():
    kv = small_kv(requests=["a"])
    s, ctx = step(("a", "t", 5)), StepContext()
    assert kv.admit(s, ctx)
    old = kv.stream("a", "t")
    kv.reset_request("a")
    assert kv.num_free_pages == 6  # parked while the step may still write them
    kv.rollback_admit(s, ctx)
    assert (old.in_flight, old.table_row, kv.num_free_pages) == (False, -1, 8)


def test_rows_of_uneven_counts_over_the_streams_of_a_decode_loop_are_admitted():
    kv = small_kv(max_pages=16)
    for r in "ab":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 3), ("b", "t", 3)))
    for _ in range(2):
        run_step(kv, step(("a", "t", 1), ("b", "t", 1)))
    run_step(kv, step(("a", "t", 1), ("b", "t", 3)))
    assert (kv.stream("a", "t").length, kv.stream("b", "t").length) == (6, 8)


def test_committing_one_step_keeps_another_live_plan_current():
    kv = small_kv(requests=["a", "b"])
    sa, ca, sb, cb = step(("a", "t", 1)), StepContext(), step(("b", "t", 1)), StepContext()
    assert kv.admit(sa, ca)
    kv.plan(sa, ca)
    assert kv.admit(sb, cb)
    plan_b = kv.plan(sb, cb)
    kv.commit(sa, ca)
    assert kv.current is plan_b


class Interrupt(Exception):
    pass


def fail_on_append(kv: KVManager, monkeypatch, nth: int) -> None:
    """``kv._append`` raises on its ``nth`` call: an admit interrupted after the pool's take."""
    real, calls = kv._append, [0]

    def append(stream, pages):
        calls[0] += 1
        if calls[0] == nth:
            raise Interrupt
        real(stream, pages)

    monkeypatch.setattr(kv, "_append", append)


def test_an_admit_interrupted_midway_gives_every_page_back(monkeypatch):
    kv = small_kv(requests=["a", "b", "c"])
    run_step(kv, step(("a", "t", 3)))
    fail_on_append(kv, monkeypatch, 2)  # c's pages are taken but not yet handed to it
    with pytest.raises(Interrupt):
        kv.admit(step(("a", "t", 2), ("b", "t", 4), ("c", "t", 4)), StepContext())
    assert kv.num_free_pages == 7
    assert (kv.stream("a", "t").length, len(kv.stream("a", "t").pages), kv.stream("a", "t").in_flight) == (3, 1, False)
    assert ("b", "t") not in kv.streams and ("c", "t") not in kv.streams
    monkeypatch.undo()
    run_step(kv, step(("a", "t", 2), ("b", "t", 4), ("c", "t", 4)))
    assert kv.num_free_pages == 4


def test_an_admit_of_kept_rows_interrupted_midway_gives_every_page_back(monkeypatch):
    kv = small_kv(max_pages=16)
    for r in "ab":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 4), ("b", "t", 4)))
    run_step(kv, step(("a", "t", 1), ("b", "t", 1)))
    run_step(kv, step(("a", "t", 3), ("b", "t", 3)))  # both rows full: the next token needs a page each
    free = kv.num_free_pages
    fail_on_append(kv, monkeypatch, 1)  # b's page is taken but not yet handed to it
    with pytest.raises(Interrupt):
        kv.admit(step(("a", "t", 1), ("b", "t", 1)), StepContext())
    assert kv.num_free_pages == free
    assert [len(kv.stream(r, "t").pages) for r in "ab"] == [2, 2]
    monkeypatch.undo()
    run_step(kv, step(("a", "t", 1), ("b", "t", 1)))
    assert kv.num_free_pages == free - 2


def test_invalidate_stream_gives_a_new_generation():
    kv = small_kv(requests=["a"])
    run_step(kv, step(("a", "t", 3)))
    before = kv.stream("a", "t").generation
    got = kv.invalidate_stream("a", "t")
    assert got == kv.stream("a", "t").generation != before


def test_token_ids_must_be_a_sequence():
    kv = prefix_kv()
    with pytest.raises(InputTypeError, match=r"token_ids must be a sequence of ints, got set"):
        kv.match_prefix({1, 2, 3}, b"m", "t")  # type: ignore[arg-type]


def test_numpy_integer_token_ids_are_taken():
    kv = prefix_kv()
    assert kv.match_prefix(list(np.arange(9)), b"m", "t") == 0
    with pytest.raises(InputTypeError, match=r"token_ids must be ints, got 1.5"):
        kv.match_prefix([1, 1.5], b"m", "t")  # type: ignore[list-item]


def publish_prompt(kv: KVManager, ids: list[int], root: bytes) -> None:
    kv.ingest_request("p")
    assert kv.admit_prefix("p", "t", ids, root)
    run_step(kv, step(("p", "t", len(ids))))


def test_a_match_under_one_root_does_not_serve_an_admit_under_another():
    kv = prefix_kv()
    ids = list(range(9))
    publish_prompt(kv, ids, b"one")
    prompt = list(ids)
    assert kv.match_prefix(prompt, b"one", "t") == 8
    kv.ingest_request("q")
    assert kv.admit_prefix("q", "t", prompt, b"two").cached_tokens == 0


def count_lookups(kv: KVManager, monkeypatch) -> list[int]:
    cache = kv.pool
    assert isinstance(cache, PrefixCache)
    real, calls = cache.lookup, [0]

    def lookup(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(cache, "lookup", lookup)
    return calls


def test_an_admit_right_after_its_match_walks_the_cache_once(monkeypatch):
    kv = prefix_kv()
    publish_prompt(kv, list(range(9)), b"m")
    calls = count_lookups(kv, monkeypatch)
    first, second = list(range(9)), [0, 1, 2, 3, 9, 9, 9, 9, 9]
    assert kv.match_prefix(first, b"m", "t") == 8
    assert kv.match_prefix(second, b"m", "t") == 4
    for rid, prompt in (("q", first), ("r", second)):
        kv.ingest_request(rid)
        kv.admit_prefix(rid, "t", prompt, b"m")
    assert calls[0] == 2
    assert (kv.stream("q", "t").length, kv.stream("r", "t").length) == (8, 4)


def test_matches_past_the_remembered_limit_start_over(monkeypatch):
    kv = prefix_kv()
    calls = count_lookups(kv, monkeypatch)
    prompts = [[i, i] for i in range(1025)]
    for p in prompts:
        kv.match_prefix(p, b"m", "t")
    kv.ingest_request("q")
    kv.admit_prefix("q", "t", prompts[0], b"m")  # forgotten: the 1025th match cleared the first 1024
    assert calls[0] == 1026


def test_check_layer_view_takes_the_layer_view_and_names_a_wrong_one():
    kv = small_kv(layers=3)
    s = kv.storage
    kv.check_layer_view(kv.layer_view(1), 1, "run")
    with pytest.raises(InputError, match=r"run: .* is layer 2's view \(layer_view\(2\)\), but layer_idx is 1"):
        kv.check_layer_view(kv.layer_view(2), 1, "run")
    with pytest.raises(InputError, match=r"is layer 0's view \(layer_view\(0\)\), but layer_idx is 2"):
        kv.check_layer_view(kv.layer_view(0), 2, "run")
    misaligned = torch.as_strided(s, s.shape[1:], s[0].stride(), storage_offset=s[0].numel() + 3)
    for other in (torch.zeros_like(s[1]), s[1].view(torch.int64), misaligned, s[1][..., :2]):
        with pytest.raises(InputError, match=r"is not a layer of this KV cache; pass layer_view\(1\) with layer_idx=1"):
            kv.check_layer_view(other, 1, "run")
    with pytest.raises(InputTypeError, match=r"kv_cache_layer must be a tensor"):
        kv.check_layer_view([1], 1, "run")
