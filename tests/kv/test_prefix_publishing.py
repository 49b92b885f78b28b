"""Pages the paged KVManager publishes to its prefix cache as streams commit: two streams that
computed the same prompt end up holding one copy (the later one takes the published page, in its
page list and its table row, and the rows kept for a decode loop see it), and a stream starts
from the cache only before its first step."""

import pytest
import torch

from mstar_core import KVConfig, KVManager, StepContext
from mstar_core.errors import StateError

from ..helpers import run_step, step
from .test_page_table import check

IDS = list(range(9))  # two full pages of 4 and one more token


def prefix_kv(max_pages=16, ps=4) -> KVManager:
    return KVManager(KVConfig(2, 1, 4, ps, max_pages, 1), "cpu", torch.float32, prefix_cache=True)


def twins(kv: KVManager, uneven: bool):
    """p and q admit the same prompt before either publishes it; one step computes both (with r,
    a stream of one token, when ``uneven``)."""
    for r in "pqr":
        kv.ingest_request(r)
    for r in "pq":
        assert kv.admit_prefix(r, "t", IDS, b"m").cached_tokens == 0
    spans = [("p", "t", 9), ("q", "t", 9)] + ([("r", "t", 1)] if uneven else [])
    return spans, run_step(kv, step(*spans))


@pytest.mark.parametrize("uneven", [False, True])
def test_the_later_twin_takes_the_published_pages_and_the_next_plans_see_them(uneven):
    kv = prefix_kv()
    spans, plan = twins(kv, uneven)
    p, q = kv.stream("p", "t"), kv.stream("q", "t")
    assert q.pages[:2] == p.pages[:2] and q.pages[2] != p.pages[2]
    before = [s.pages for s in plan.layout("t").spans]
    assert before[1][:2] != tuple(p.pages[:2])  # the plan made before keeps the pages it read
    kv.post_warmup_validate()
    decode = [(r, "t", 1) for r, _, _ in spans]
    for _ in range(4):
        check(run_step(kv, step(*decode)).layout("t"))
    assert kv.num_free_pages == 16 - 6 - (2 if uneven else 0)  # p's 4 pages, q's 2 of its own, r's 2


def test_a_stream_with_a_step_in_flight_does_not_start_from_the_cache():
    kv = prefix_kv()
    kv.ingest_request("a")
    s, ctx = step(("a", "t", 0)), StepContext()
    assert kv.admit(s, ctx)  # in flight, though it holds no token nor page
    with pytest.raises(StateError, match=r"the stream already holds 0 tokens \(or a step in flight\)"):
        kv.admit_prefix("a", "t", IDS, b"m")


def test_a_kept_row_started_from_the_cache_plans_from_its_cached_tokens():
    kv = prefix_kv()
    for r in "pa":
        kv.ingest_request(r)
    assert kv.admit_prefix("p", "t", IDS, b"m")
    run_step(kv, step(("p", "t", 9)))
    run_step(kv, step(("a", "t", 0)))  # the stream exists, empty, in the kept rows
    assert kv.admit_prefix("a", "t", IDS, b"m").cached_tokens == 8
    lay = run_step(kv, step(("a", "t", 1))).layout("t")
    check(lay)
    assert lay.positions.tolist() == [8]
