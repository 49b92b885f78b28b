"""A decode loop over the same streams plans from the rows the manager keeps across steps: every
plan still says what the host page lists say, and whatever else changes a stream in between (a
reset, a fork, another step on it, a rollback, a refusal) is seen by the next plan."""

import pytest

from mstar_core import KVSpan, KVStep, Step, StepContext

from ..helpers import small_kv
from .test_page_table import check


def decode(*rids, n=1, commit=True):
    return Step(KVStep(tuple(KVSpan(r, "t", n, commit=commit) for r in rids)))


def setup(lengths=(5, 2, 7), max_pages=200):
    kv = small_kv(max_pages=max_pages, page_size=4)
    rids = [f"r{i}" for i in range(len(lengths))]
    for r in rids:
        kv.ingest_request(r)
    step(kv, Step(KVStep(tuple(KVSpan(r, "t", n) for r, n in zip(rids, lengths, strict=True)))))
    return kv, rids


def step(kv, st, commit=True):
    """Admit, plan and commit (or roll back) ``st``; checks the plan against the host page lists
    and the spans against the streams; returns the layout."""
    ctx = StepContext()
    assert kv.admit(st, ctx)
    lay = kv.plan(st, ctx).layout("t")
    check(lay)
    for s in lay.spans:
        stream = kv.stream(s.request_id, "t")
        assert (s.prefix_len, s.generation, s.num_pages) == (stream.length, stream.generation, len(stream.pages))
    if commit:
        kv.commit(st, ctx)
    else:
        kv.rollback_admit(st, ctx)
    return lay


def test_a_decode_loop_plans_what_the_page_lists_say():
    kv, rids = setup()
    st = decode(*rids)
    for i in range(40):  # rows cross page boundaries at different steps
        lay = step(kv, st)
        assert [s.length for s in lay.spans] == [n + i + 1 for n in (5, 2, 7)]
        if i:
            assert kv._batch is not None and kv._batch.keys == st.kv.keys()  # the kept rows were used
    kv.post_warmup_validate()


def _reset(kv, rids):
    kv.reset_request(rids[0])
    step(kv, Step(KVStep((KVSpan(rids[0], "t", 3),))))


def _fork(kv, rids):
    kv.ingest_request("f")
    assert kv.fork(rids[1], "f", "t")


def _invalidate(kv, rids):
    kv.invalidate_stream(rids[2], "t")


def _other_step(kv, rids):
    step(kv, Step(KVStep((KVSpan(rids[0], "t", 6),))))


def _rollback(kv, rids):
    step(kv, decode(*rids), commit=False)


def _uncommitted(kv, rids):
    step(kv, decode(*rids, n=5, commit=False))


def _wider(kv, rids):
    step(kv, decode(*rids, n=3))


def _remove_and_back(kv, rids):
    kv.remove_request(rids[1])
    kv.ingest_request(rids[1])
    step(kv, Step(KVStep((KVSpan(rids[1], "t", 9),))))


@pytest.mark.parametrize("change", [_reset, _fork, _invalidate, _other_step, _rollback, _uncommitted, _wider,
                                    _remove_and_back])
def test_a_change_between_decode_steps_is_seen(change):
    kv, rids = setup()
    st = decode(*rids)
    for _ in range(3):
        step(kv, st)
    change(kv, rids)
    for _ in range(6):
        step(kv, st)
    kv.post_warmup_validate()


def test_a_refused_decode_step_changes_nothing_and_the_next_one_plans():
    kv, rids = setup(lengths=(4, 4, 4), max_pages=5)  # a full page each, 2 free: the next tokens need 3
    st = decode(*rids)
    for refusal in range(2):
        free = kv.num_free_pages
        out = kv.admit(st, StepContext())
        assert not out and out.shortages[0].needed == 3 - refusal and kv.num_free_pages == free
        kv.remove_request(rids.pop())
        st = decode(*rids)
        step(kv, st)
        while any(kv.stream(r, "t").length % 4 for r in rids):
            step(kv, st)  # up to the next page boundary: then each row needs a page again
    kv.post_warmup_validate()


def test_a_kept_step_admitted_twice_is_refused():
    kv, rids = setup()
    st = decode(*rids)
    step(kv, st)
    ctx = StepContext()
    assert kv.admit(st, ctx)
    with pytest.raises(RuntimeError, match="neither committed nor rolled back"):
        kv.admit(st, StepContext())
    kv.plan(st, ctx)
    kv.commit(st, ctx)
    step(kv, st)


def test_a_step_planned_and_not_yet_landed_is_refused_a_second_admit():
    kv = small_kv(max_pages=20, page_size=4)
    for r in "ab":
        kv.ingest_request(r)
    st, ctx = decode("a", "b", n=2), StepContext()
    assert kv.admit(st, ctx)
    kv.plan(st, ctx)  # the plan keeps its rows, in flight
    with pytest.raises(RuntimeError, match="neither committed nor rolled back"):
        kv.admit(st, StepContext())
    kv.commit(st, ctx)
    assert [s.length for s in step(kv, st).spans] == [4, 4]
    kv.post_warmup_validate()


def _snapshot(kv):
    return (kv.num_free_pages, {k: (s.length, list(s.pages), s.generation, s.in_flight)
                                for k, s in kv.streams.items()})


def _layout(plan):
    lay = plan.layout("t")
    return ([a.tolist() for a in (lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len, lay.kv_lens,
                                  lay.write_pages, lay.write_offsets, lay.positions)], lay.spans)


@pytest.mark.parametrize("seed", range(3))
def test_kept_rows_plan_what_reading_the_streams_plans(monkeypatch, seed):
    """Two managers driven alike, one never keeping rows: every outcome, plan and stream agrees."""
    import random

    import mstar_core.kv.paged as paged

    rng = random.Random(seed)
    kept, plain = small_kv(max_pages=60, page_size=4), small_kv(max_pages=60, page_size=4)
    rids = [f"r{i}" for i in range(5)]
    for kv in (kept, plain):
        for r in rids:
            kv.ingest_request(r)
    steps = {}  # step objects reused, as a decode loop reuses its step

    def drive(kv, op, arg, keep):
        with monkeypatch.context() as m:
            if not keep:
                m.setattr(paged, "RowBatch", lambda *a, **k: None)
            if op == "step":
                st, commit = arg
                ctx = StepContext()
                out = kv.admit(st, ctx)
                if not out:
                    return out, None
                got = _layout(kv.plan(st, ctx))
                (kv.commit if commit else kv.rollback_admit)(st, ctx)
                return out, got
            if op == "reset":
                return kv.reset_request(arg)
            if op == "fork":
                kv.ingest_request(arg[1])
                return kv.fork(arg[0], arg[1], "t")
            return kv.invalidate_stream(arg, "t")

    last = None
    for _ in range(400):
        live = sorted({k[0] for k in plain.streams})
        x = rng.random()
        if last is not None and x < 0.6:  # mostly the same step again: a decode loop
            op, arg = "step", (last, True)
        elif x < 0.65 and live:
            op, arg = "reset", rng.choice(live)
        elif x < 0.68 and live:
            op, arg = "fork", (rng.choice(live), f"f{len(rids)}")
            rids.append(arg[1])
        elif x < 0.7 and live:
            op, arg = "invalidate", rng.choice(live)
        else:
            chosen = tuple(rng.sample(rids, k=min(len(rids), rng.randint(1, 4))))
            n = rng.choice([1, 1, 1, 1, 2, 5])
            key = (chosen, n, rng.random() < 0.1)
            st = steps.setdefault(key, decode(*chosen, n=n, commit=not key[2]))
            op, arg = "step", (st, rng.random() > 0.1)
            last = st
        a, b = drive(kept, op, arg, True), drive(plain, op, arg, False)
        assert a == b and _snapshot(kept) == _snapshot(plain), (op, arg)
    kept.post_warmup_validate()


def test_a_new_step_object_over_the_same_streams_plans_from_the_kept_rows():
    kv, rids = setup()
    step(kv, decode(*rids))
    kept = kv._batch
    for _ in range(3):
        step(kv, decode(*rids))  # equal keys, another tuple: the rows are kept all the same
    assert kv._batch is kept


def test_a_refused_decode_step_keeps_the_rows_for_a_smaller_one():
    kv, rids = setup(lengths=(3, 3), max_pages=4)
    st = decode(*rids)
    step(kv, st)  # both rows full: 2 pages free
    kept = kv._batch
    assert not kv.admit(decode(*rids, n=5), StepContext())  # 2 pages a row: refused
    lay = step(kv, st)
    assert kv._batch is kept and [s.length for s in lay.spans] == [5, 5]


def test_a_kept_row_that_gets_its_first_page_plans_from_its_new_table_row():
    kv, rids = setup(lengths=(0, 0))  # streams without a page, and without a table row
    st = decode(*rids)
    for _ in range(5):
        lay = step(kv, st)
    assert [s.length for s in lay.spans] == [5, 5]


def test_a_subset_admit_between_kept_steps_is_seen_by_the_next_admit():
    kv, rids = setup()
    st = decode(*rids)
    step(kv, st)
    ctx = StepContext()
    one = decode(rids[0])
    assert kv.admit(one, ctx)  # the first row is in flight now
    with pytest.raises(RuntimeError, match="neither committed nor rolled back"):
        kv.admit(st, StepContext())
    kv.rollback_admit(one, ctx)
    step(kv, st)


def test_an_invalidated_stream_is_seen_after_any_later_change():
    kv, rids = setup()
    kv.ingest_request("other")
    st = decode(*rids)
    for _ in range(2):
        step(kv, st)
    kv.invalidate_stream(rids[1], "t")
    kv.reset_request("other")
    step(kv, st)  # checks each span's generation against its stream's


def test_a_plan_of_some_of_the_kept_streams_lays_out_those():
    kv, rids = setup()
    st = decode(*rids)
    step(kv, st)
    ctx = StepContext()
    assert kv.admit(st, ctx)
    lay = kv.plan(decode(rids[1]), ctx).layout("t")
    check(lay)
    assert [s.request_id for s in lay.spans] == [rids[1]]
    kv.rollback_admit(st, ctx)
