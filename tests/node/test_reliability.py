"""The lifecycle rules of the paged KV manager, the attention managers and the runners: what a
step took is recorded in its context and released exactly once; plans are per step, not per
manager; a failure anywhere leaves the managers as they were."""

import pytest
import torch

from mstar_core import CommitError, KVManager, KVSpan, KVStep, Node, Step, StepContext

from ..helpers import Logged, tiny_graph_node


def build(graphs=False, slots=2, max_pages=64):
    return tiny_graph_node(graphs, slots, max_pages=max_pages)


def snapshot(kv: KVManager):
    return (
        sorted(kv.pool.used), kv.pool.num_free,
        {k: (tuple(s.pages), s.length, s.generation, s.in_flight) for k, s in kv.streams.items()},
        tuple(kv.requests),
    )


def step_of(**lens):
    return Step(KVStep(tuple(KVSpan(r, "text", n) for r, n in lens.items())))


def prefill(runner, node, prompts):
    for r in prompts:
        node.ingest_request(r)
    prep = runner.prepare(step_of(**{r: len(p) for r, p in prompts.items()}))
    return runner.launch(prep, torch.tensor([t for p in prompts.values() for t in p]))


# -- plans are per step --------------------------------------------------------------------------

@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_second_prepare_before_launch_runs_each_step_through_its_own_plan(graphs):
    model, kv, attn, node, runner = build(graphs)
    runner.warmup()
    a, b = {"a1": [1, 2, 3], "a2": [4, 5]}, {"b1": [6, 7, 8, 9], "b2": [10]}
    prefill(runner, node, {**a, **b})
    pa = runner.prepare(step_of(a1=1, a2=1))
    pb = runner.prepare(step_of(b1=1, b2=1))  # planned after A: the managers' latest plan is B's
    assert (pa.graph is not None) == graphs
    out_a = runner.launch(pa, torch.tensor([11, 12])).clone()
    out_b = runner.launch(pb, torch.tensor([13, 14])).clone()
    for out, seqs in ((out_a, {"a1": [1, 2, 3, 11], "a2": [4, 5, 12]}),
                      (out_b, {"b1": [6, 7, 8, 9, 13], "b2": [10, 14]})):
        for i, toks in enumerate(seqs.values()):
            want = model.forward_full(torch.tensor(toks))[-1]
            torch.testing.assert_close(out[i], want, rtol=1e-9, atol=1e-9)
    assert {r: kv.stream(r, "text").length for r in ("a1", "a2", "b1", "b2")} == {"a1": 4, "a2": 3, "b1": 5, "b2": 2}


def test_graph_prepare_past_the_slots_is_refused_before_admitting():
    model, kv, attn, node, runner = build(graphs=True)
    runner.warmup()
    prefill(runner, node, {"a": [1, 2], "b": [2, 3], "c": [3, 4]})
    pa, pb = runner.prepare(step_of(a=1)), runner.prepare(step_of(b=1))
    assert (pa.ctx.slot, pb.ctx.slot) == (0, 1)
    before = snapshot(kv)
    with pytest.raises(RuntimeError, match="staging slot 0 still holds a prepared step"):
        runner.prepare(step_of(c=1))
    assert snapshot(kv) == before
    runner.launch(pa, torch.tensor([4]))
    pc = runner.prepare(step_of(c=1))  # slot 0 is free again
    assert pc.ctx.slot == 0
    runner.discard(pb)
    runner.discard(pc)
    assert not any(s.in_flight for s in kv.streams.values())


def test_eager_wrapper_replanned_by_a_later_step_is_refused_and_rolled_back():
    model, kv, attn, node, runner = build()
    prefill(runner, node, {"a": [1, 2], "b": [3], "c": [4, 5, 6, 7]})
    free = kv.num_free_pages
    pa = runner.prepare(step_of(a=1))
    pb, pc = runner.prepare(step_of(b=1)), runner.prepare(step_of(c=1))  # three plans over two slots
    with pytest.raises(RuntimeError, match="re-planned by a later step"):
        runner.launch(pa, torch.tensor([7]))
    assert kv.stream("a", "text").length == 2 and not kv.stream("a", "text").in_flight
    runner.launch(pb, torch.tensor([8]))
    runner.launch(pc, torch.tensor([9]))
    assert kv.num_free_pages == free - 1  # c's fourth token opened a page; a's step gave its own back


def test_nested_step_does_not_redirect_the_outer_steps_writes():
    model, kv, attn, node, runner = build()
    prefill(runner, node, {"a": [1, 2, 3], "b": [4, 5]})
    seen = {}

    def outer(ctx):
        inner = node.step(step_of(b=1), lambda c: model.forward_step(
            torch.tensor([9]), c.plan_results["kv"].layout("text").positions, kv, attn, "text"))
        seen["inner"] = inner.output[-1].clone()
        return model.forward_step(torch.tensor([8]), ctx.plan_results["kv"].layout("text").positions, kv, attn, "text")

    res = node.step(step_of(a=1), outer)
    torch.testing.assert_close(res.output[-1], model.forward_full(torch.tensor([1, 2, 3, 8]))[-1], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(seen["inner"], model.forward_full(torch.tensor([4, 5, 9]))[-1], rtol=1e-9, atol=1e-9)


# -- commit, plan and admit are tied to one admit record ----------------------------------------

def admitted(kv, attn, step):
    node = Node([kv, attn])
    ctx = StepContext()
    assert node.admit(step, ctx)
    return node, ctx


def test_commit_twice_after_rollback_or_without_admit_is_refused():
    _, kv, attn, node, _ = build()
    node.ingest_request("a")
    step = step_of(a=3)
    n, ctx = admitted(kv, attn, step)
    n.plan(step, ctx)
    n.commit(step, ctx)
    before = snapshot(kv)
    for ctx2 in (ctx, StepContext()):  # committed already; never admitted
        with pytest.raises(RuntimeError, match=r"commit of streams \[\('a', 'text'\)\].*no live admit"):
            kv.commit(step, ctx2)
        assert snapshot(kv) == before
    n, ctx = admitted(kv, attn, step)
    n.rollback_admit(step, ctx)
    with pytest.raises(RuntimeError, match="no live admit"):
        kv.commit(step, ctx)
    assert snapshot(kv) == before and kv.stream("a", "text").length == 3


def test_plan_without_admit_and_second_admit_into_a_context_are_refused():
    _, kv, attn, node, _ = build()
    node.ingest_request("a")
    node.ingest_request("b")
    node.step(step_of(a=2), lambda ctx: None)  # page slack: a plan without admit would fit
    with pytest.raises(RuntimeError, match=r"plan of streams \[\('a', 'text'\)\]"):
        kv.plan(step_of(a=1), StepContext())
    ctx = StepContext()
    assert kv.admit(step_of(a=1), ctx)
    before = snapshot(kv)
    with pytest.raises(RuntimeError, match="already holds an admitted step"):
        kv.admit(step_of(b=1), ctx)
    assert snapshot(kv) == before


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_admit_interrupted_midway_leaves_nothing_taken(monkeypatch, exc):
    _, kv, attn, node, _ = build()
    for r in "abc":
        node.ingest_request(r)
    node.step(step_of(a=5), lambda ctx: None)
    before = snapshot(kv)
    append, calls = kv._append, []

    def flaky(stream, pages):
        # the second stream's pages: taken from the pool, recorded, not yet on the stream
        calls.append(len(pages))
        if len(calls) == 2:
            raise exc("interrupted")
        return append(stream, pages)

    monkeypatch.setattr(kv, "_append", flaky)
    with pytest.raises(exc):
        node.step(step_of(a=4, b=9, c=1), lambda ctx: None)
    assert len(calls) == 2 and snapshot(kv) == before
    monkeypatch.setattr(kv, "_append", append)
    assert node.step(step_of(a=4, b=9, c=1), lambda ctx: None).outcome


Recorder = Logged


def test_rollback_runs_in_reverse_dependency_order_across_resources():
    log = []
    # Given in an order unlike the dependency order: c -> b -> a.
    node = Node([Recorder("c", log, ["b"]), Recorder("a", log), Recorder("b", log, ["a"])])
    ctx = StepContext()
    node.admit(Step(KVStep(())), ctx)
    assert log == [("admit", "a"), ("admit", "b"), ("admit", "c")]
    log.clear()
    node.rollback_admit(Step(KVStep(())), ctx)
    assert log == [("rollback", "c"), ("rollback", "b"), ("rollback", "a")]
    log.clear()
    with pytest.raises(ZeroDivisionError):
        node.step(Step(KVStep(())), lambda ctx: 1 / 0)
    assert log[-3:] == [("rollback", "c"), ("rollback", "b"), ("rollback", "a")]


def test_a_failing_commit_rolls_back_the_rest_and_says_what_committed():
    _, kv, attn, _, _ = build()
    log = []
    node = Node([kv, attn, Recorder("late", log, ["attn"], fail_commit=True)])
    node.ingest_request("a")
    with pytest.raises(CommitError) as err:
        node.step(step_of(a=3), lambda ctx: None)
    e = err.value
    assert e.failed == "late" and e.committed == ("kv", "attn") and e.rolled_back == ("late",)
    assert "do not re-run" in str(e) and "disk full" in str(e)
    assert kv.stream("a", "text").length == 3 and not kv.stream("a", "text").in_flight
    log.clear()
    node2 = Node([Recorder("early", log, fail_commit=True), kv, attn])
    with pytest.raises(CommitError) as err:
        node2.step(step_of(a=1), lambda ctx: None)
    assert err.value.committed == () and set(err.value.rolled_back) == {"early", "kv", "attn"}
    # kv was rolled back, not committed: no stream in flight, the length unchanged
    assert kv.stream("a", "text").length == 3 and not kv.stream("a", "text").in_flight
    assert kv.num_free_pages == kv.config.max_pages - 1


# -- boundaries ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [-1, 2, 2.0, True])
def test_layer_index_out_of_range_is_refused(layer):
    _, kv, attn, node, _ = build()
    node.ingest_request("a")
    node.admit(step_of(a=1), ctx := StepContext())
    node.plan(step_of(a=1), ctx)
    k = torch.zeros(1, 2, 16, dtype=torch.float64)
    before = kv.storage.clone()
    with pytest.raises(IndexError, match=rf"layer_idx {layer!r} out of range.*0\.\.1"):
        kv.write_kv(k + 1, k + 1, layer_idx=layer, label="text")
    with pytest.raises(IndexError, match="out of range"):
        kv.layer_view(layer)
    assert torch.equal(kv.storage, before)


def test_launch_with_the_wrong_token_count_is_refused_and_the_step_stays_prepared():
    model, kv, attn, node, runner = build(graphs=True)
    runner.warmup()
    prefill(runner, node, {"a": [1, 2], "b": [3]})
    prep = runner.prepare(step_of(a=1, b=1))
    for bad in (torch.tensor([5]), torch.tensor([[5, 6]]), [5, 6]):
        with pytest.raises(ValueError, match="1-D tensor of the step's 2 tokens"):
            runner.launch(prep, bad)
    out = runner.launch(prep, torch.tensor([5, 6]))
    torch.testing.assert_close(out[1], model.forward_full(torch.tensor([3, 6]))[-1], rtol=1e-9, atol=1e-9)


def test_q_on_another_device_than_the_cache_is_refused():
    _, kv, attn, node, _ = build()
    node.ingest_request("a")
    node.admit(step_of(a=1), ctx := StepContext())
    node.plan(step_of(a=1), ctx)
    q = torch.zeros(1, 4, 16, dtype=torch.float64, device="meta")
    with pytest.raises(ValueError, match="q is on meta"):
        attn.run(q, "text", kv.layer_view(0))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("how", ["reset", "remove"])
def test_a_stale_pending_step_writes_only_its_own_parked_pages(graphs, how):
    """A request reset or removed while its step is prepared: that step may still run (a replayed
    graph writes without the host seeing it), so the old stream's pages stay out of the pool until
    it lands; another request never gets them meanwhile, and they go back exactly once."""
    model, kv, attn, node, runner = build(graphs, max_pages=9)
    runner.warmup()
    prefill(runner, node, {"a": [1, 2, 3, 4, 5], "b": [6, 7]})
    pa = runner.prepare(step_of(a=1, b=1))
    old_pages = set(kv.stream("a", "text").pages)
    free = kv.num_free_pages
    (node.reset_request if how == "reset" else node.remove_request)("a")
    assert kv.num_free_pages == free  # parked, not returned
    node.ingest_request("c")
    out_c = node.step(step_of(c=free * 4), lambda ctx: model.forward_step(
        torch.arange(free * 4) % 50, ctx.plan_results["kv"].layout("text").positions, kv, attn, "text"))
    assert out_c.outcome and not set(kv.stream("c", "text").pages) & old_pages
    c_pages = list(kv.stream("c", "text").pages)
    c_kv = kv.storage[:, c_pages].clone()
    assert not node.step(step_of(c=1), lambda ctx: None).outcome  # the parked pages are not free
    out = runner.launch(pa, torch.tensor([9, 10]))  # the stale step runs over its parked pages
    torch.testing.assert_close(out[1], model.forward_full(torch.tensor([6, 7, 10]))[-1], rtol=1e-9, atol=1e-9)
    assert torch.equal(kv.storage[:, c_pages], c_kv)
    assert kv.num_free_pages == len(old_pages)  # back once the step landed; a's span was dropped
    assert kv.stream("b", "text").length == 3
    assert how == "remove" or kv.stream("a", "text").length == 0
    kv.post_warmup_validate()
