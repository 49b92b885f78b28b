"""What a step leaves behind when it fails: an exception in admit, plan or forward rolls the
step's reservations back; a request reset or removed between admit and commit/rollback is
skipped, not corrupted; a step cannot be admitted or launched twice."""

import pytest
import torch

from mstar_core import (
    AdmitOutcome,
    GraphRunner,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Resource,
    Step,
    StepContext,
)

from ..helpers import REF_WRAPPERS, small_kv


class Boom(Resource):
    """A resource that raises in the hook named by ``where``."""

    def __init__(self, where):
        self.name, self.where, self.armed = "boom", where, False

    def depends_on(self):
        return ("kv",)

    def admit(self, step, ctx):
        if self.armed and self.where == "admit":
            raise RuntimeError("admit failed")
        return AdmitOutcome.ok()

    def plan(self, step, ctx):
        if self.armed and self.where == "plan":
            raise RuntimeError("plan failed")


def held(kv):
    return {k: (list(s.pages), s.length) for k, s in kv.streams.items()}


@pytest.mark.parametrize("where", ["admit", "plan", "forward"])
def test_an_exception_in_a_step_rolls_its_admit_back(where):
    kv, boom = small_kv(max_pages=8), Boom(where)
    node = Node([kv, boom])
    node.ingest_request("x")
    node.step(Step(KVStep((KVSpan("x", "t", 3),))), lambda ctx: None)
    before, free = held(kv), kv.num_free_pages
    boom.armed = True

    def forward(ctx):
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError, match=f"{where} failed"):
        node.step(Step(KVStep((KVSpan("x", "t", 6),))), forward)
    assert held(kv) == before and kv.num_free_pages == free
    boom.armed = False  # and the stream is not left "in flight": the next step runs
    assert node.step(Step(KVStep((KVSpan("x", "t", 1),))), lambda ctx: None).outcome
    assert kv.stream("x", "t").length == 4


def test_rollback_and_commit_skip_streams_reset_or_removed_after_admit():
    kv = small_kv(max_pages=8)
    for r in ("a", "b"):
        kv.ingest_request(r)
    step = Step(KVStep((KVSpan("a", "t", 5), KVSpan("b", "t", 5))))
    ctx = StepContext()
    assert kv.admit(step, ctx)
    kv.remove_request("a")
    kv.rollback_admit(step, ctx)  # b's pages go back; a's went back with the remove
    assert kv.num_free_pages == 8 and ("b", "t") not in kv.streams

    ctx = StepContext()
    kv.ingest_request("a")
    assert kv.admit(step, ctx)
    kv.plan(step, ctx)
    kv.reset_request("a")
    kv.commit(step, ctx)  # a's span is dropped: it holds no pages for those tokens any more
    assert kv.stream("a", "t").length == 0 and kv.stream("a", "t").pages == []
    assert kv.stream("b", "t").length == 5 and kv.num_free_pages == 6
    kv.post_warmup_validate()


def test_a_stale_step_after_reset_and_readmit_touches_nothing_of_the_new_one():
    """Step A is admitted, the request is reset and step B admitted on the fresh stream (often
    on the very pages A had): A's late commit or rollback must leave B alone."""
    kv = small_kv(max_pages=8, page_size=4)
    kv.ingest_request("r")

    def step(n):
        return Step(KVStep((KVSpan("r", "t", n),)))

    for late in ("commit", "rollback"):
        kv.reset_request("r")
        s0, c0 = step(4), StepContext()
        assert kv.admit(s0, c0)
        kv.plan(s0, c0)
        kv.commit(s0, c0)
        a, ca = step(1), StepContext()
        assert kv.admit(a, ca)
        kv.plan(a, ca)
        kv.reset_request("r")
        b, cb = step(5), StepContext()
        assert kv.admit(b, cb)
        kv.plan(b, cb)
        b_pages = list(kv.stream("r", "t").pages)
        getattr(kv, "commit" if late == "commit" else "rollback_admit")(a, ca)
        assert kv.stream("r", "t").pages == b_pages and kv.stream("r", "t").length == 0, late
        with pytest.raises(RuntimeError, match="neither committed nor rolled back"):
            kv.admit(step(1), StepContext())  # B is still in flight
        kv.commit(b, cb)
        assert kv.stream("r", "t").length == 5 and kv.num_free_pages == 8 - 2, late
        kv.post_warmup_validate()


def test_a_stream_cannot_be_admitted_twice_before_commit():
    kv = small_kv()
    kv.ingest_request("a")
    step = Step(KVStep((KVSpan("a", "t", 1),)))
    ctx = StepContext()
    assert kv.admit(step, ctx)
    with pytest.raises(RuntimeError, match=r"\('a', 't'\).*neither committed nor rolled back"):
        kv.admit(step, StepContext())
    kv.plan(step, ctx)
    kv.commit(step, ctx)
    assert kv.admit(step, StepContext())


def test_post_warmup_validate_catches_a_stream_longer_than_its_pages():
    kv = small_kv()
    kv.ingest_request("a")
    node = Node([kv])
    node.step(Step(KVStep((KVSpan("a", "t", 4),))), lambda ctx: None)
    kv.stream("a", "t").length = 9  # corrupt: 9 tokens in one page of 4
    with pytest.raises(RuntimeError, match="fewer pages than their length"):
        kv.post_warmup_validate()


def test_a_refusal_names_only_the_requests_that_do_not_fit():
    kv = small_kv(max_pages=3)
    for r in ("a", "b", "c"):
        kv.ingest_request(r)
    step = Step(KVStep((KVSpan("a", "t", 4), KVSpan("b", "t", 12), KVSpan("c", "t", 4))))
    out = kv.admit(step, StepContext())
    assert not out
    assert out.reason() == "kv: needs 5 pages, 3 free; kv: needs 3 pages for request 'b', 2 free"
    assert kv.num_free_pages == 3


def graph_runner(kv, slots=2):
    attn = PagedAttentionManager(kv, "cpu", torch.float64, kv.config, REF_WRAPPERS, accelerator_graph=True)
    node = Node([kv, attn])
    return node, GraphRunner(node, lambda ctx, tokens: torch.zeros(tokens.shape[0], 3, dtype=torch.float64),
                             buckets=[2], device="cpu", label="t", slots=slots)


def test_graph_runner_needs_two_slots_where_a_resource_forces_double_buffering():
    with pytest.raises(ValueError, match=r"slots=1; resources \['attn'\] force double-buffered staging"):
        graph_runner(small_kv(), slots=1)


def test_a_prepared_step_launches_once():
    kv = small_kv()
    node, runner = graph_runner(kv)
    node.ingest_request("a")
    prep = runner.prepare(Step(KVStep((KVSpan("a", "t", 3),))))
    runner.launch(prep, torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="already launched or discarded"):
        runner.launch(prep, torch.zeros(3, dtype=torch.long))
    runner.discard(prep)  # a no-op: it ran
    assert kv.stream("a", "t").length == 3 and kv.num_free_pages == kv.config.max_pages - 1


def test_a_failed_warmup_leaves_no_dummy_request_behind():
    kv = small_kv(max_pages=2)  # the sink page + 1: a bucket of 2 dummies cannot be admitted
    node, runner = graph_runner(kv)
    with pytest.raises(RuntimeError, match="graph warm-up for bucket 2"):
        runner.warmup()
    assert kv.requests == () and kv.streams == {} and kv.num_free_pages == 1


def test_attention_depends_on_the_kv_it_was_built_over():
    from mstar_core import KVManager

    kv = small_kv()
    named = KVManager(kv.config, "cpu", torch.float64, name="kv_text")
    attn = PagedAttentionManager(named, "cpu", torch.float64, kv.config, REF_WRAPPERS)
    assert attn.depends_on() == ("kv_text",)
    assert [r.name for r in Node([attn, named]).resources] == ["kv_text", "attn"]
