"""Property: after any sequence of lifecycle calls, free + used pages equal the total and no
page belongs to two streams."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar_core import KVSpan, KVStep, Step, StepContext
from mstar_core.kv.pool import PagePool

from ..helpers import small_kv

RIDS = ["a", "b", "c"]
LABELS = ["t", "u"]

op = st.one_of(
    st.tuples(st.just("ingest"), st.sampled_from(RIDS)),
    st.tuples(st.just("remove"), st.sampled_from(RIDS)),
    st.tuples(st.just("reset"), st.sampled_from(RIDS), st.booleans()),
    st.tuples(
        st.just("step"),
        st.lists(st.tuples(st.sampled_from(RIDS), st.sampled_from(LABELS), st.integers(0, 9), st.booleans()),
                 min_size=1, max_size=4, unique_by=lambda s: (s[0], s[1])),
        st.sampled_from(["commit", "rollback"]),
    ),
)


def check(kv):
    owned = [p for s in kv.streams.values() for p in s.pages]
    assert len(owned) == len(set(owned)), "a page belongs to two streams"
    assert set(owned) == set(kv.pool.used)
    assert kv.pool.num_free + len(kv.pool.used) == kv.config.max_pages
    for s in kv.streams.values():
        assert len(s.pages) == -(-s.length // kv.config.page_size), "a stream holds pages it does not fill"


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=25))
def test_page_accounting(ops):
    kv = small_kv(max_pages=10, page_size=3)
    for o in ops:
        if o[0] == "ingest":
            kv.ingest_request(o[1])
        elif o[0] == "remove":
            kv.remove_request(o[1])
        elif o[0] == "reset":
            kv.reset_request(o[1], free=o[2])
        else:
            spans = [s for s in o[1] if s[0] in kv.requests]
            if not spans:
                continue
            step = Step(KVStep(tuple(KVSpan(*s) for s in spans)))
            ctx = StepContext()
            free_before = kv.num_free_pages
            if not kv.admit(step, ctx):
                assert kv.num_free_pages == free_before  # a refusal takes nothing
            elif o[2] == "rollback":
                kv.rollback_admit(step, ctx)
                assert kv.num_free_pages == free_before
            else:
                kv.plan(step, ctx)
                kv.commit(step, ctx)
        check(kv)
    kv.post_warmup_validate()


def test_pool_hands_returned_pages_out_again_in_the_order_they_were_returned():
    """The pool is a stack: the pages just given back are the next handed out, in the order they
    were given back, so the same calls always give the same pages."""
    pool = PagePool(8)
    assert pool.take(5) == [0, 1, 2, 3, 4]
    pool.give_back([3, 1, 4])
    assert pool.take(2) == [3, 1]
    assert pool.take(2) == [4, 5]
    assert pool.num_free == 2 and pool.used == frozenset({0, 1, 2, 3, 4, 5})


def test_pool_refuses_a_page_given_back_twice_in_one_call():
    """Returning the same page twice in one ``give_back`` is a double free: refused, and the pool
    is left as it was (the page is not listed free twice)."""
    pool = PagePool(4)
    pages = pool.take(3)
    with pytest.raises(RuntimeError, match=r"pages \[1\] returned but not in use \(double free\)"):
        pool.give_back([1, 2, 1])
    assert pool.num_free == 1 and pool.used == frozenset(pages)
    pool.give_back(pages)
    assert pool.num_free == 4 and sorted(pool.take(4)) == [0, 1, 2, 3]


def test_pool_refuses_a_page_that_is_not_in_use_and_names_it():
    """A page never taken, or taken and given back already, is refused (a double free), the
    message names it, and the pool is left as it was."""
    pool = PagePool(4)
    pages = pool.take(2)
    pool.give_back([1])
    for bad in ([3], [1], [0, 3]):
        with pytest.raises(RuntimeError, match=rf"pages \[{bad[-1]}\] returned but not in use \(double free\)"):
            pool.give_back(bad)
        assert pool.num_free == 3 and pool.used == frozenset({0})
    assert pages == [0, 1] and pool.take(3) == [1, 2, 3]
