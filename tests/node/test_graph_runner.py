"""GraphRunner on a CPU: decode steps replayed from "captured" closures over static buffers
(plans updated in place, two slots, padded buckets) give the no-cache forward's logits."""

import torch

from mstar_core import AttentionStep, KVSpan, KVStep, Step

from ..helpers import step, tiny_graph_node


def build(graphs=True):
    model, kv, _, node, runner = tiny_graph_node(graphs)
    return model, kv, node, runner


def test_graph_decode_matches_no_cache_forward_with_preplan():
    model, kv, node, runner = build()
    free0 = kv.num_free_pages
    runner.warmup()
    assert runner.enabled and kv.num_free_pages == free0 - 1  # only the sink page stays taken
    prompts = {"a": [1, 2, 3, 4, 5], "b": [7, 8], "c": [9, 10, 11, 12, 13, 14, 15]}
    seqs = {r: list(p) for r, p in prompts.items()}
    for r in prompts:
        node.ingest_request(r)
    pre = Step(KVStep(tuple(KVSpan(r, "text", len(p)) for r, p in prompts.items())))
    prep = runner.prepare(pre)
    assert prep.graph is None  # a prefill step runs eagerly
    logits = runner.launch(prep, torch.tensor([t for p in prompts.values() for t in p]))
    ends = torch.tensor([len(p) for p in prompts.values()]).cumsum(0) - 1
    got = {r: [logits[i]] for r, i in zip(prompts, ends, strict=True)}
    nxt = logits[ends].argmax(-1)
    decode = Step(KVStep(tuple(KVSpan(r, "text", 1) for r in prompts)))
    prep = runner.prepare(decode)
    slots = []
    for _ in range(5):
        assert prep.graph is not None and prep.ctx.bucket == 4
        slots.append(prep.ctx.slot)
        for r, t in zip(prompts, nxt.tolist(), strict=True):
            seqs[r].append(t)
        out = runner.launch(prep, nxt)
        prep = runner.prepare(decode)  # pre-plan step N+1 before step N's output is read
        for i, r in enumerate(prompts):
            got[r].append(out[i].clone())
        nxt = out.argmax(-1)
    assert slots == [0, 1, 0, 1, 0]
    for r in prompts:
        full = model.forward_full(torch.tensor(seqs[r]))
        want = full[len(prompts[r]) - 1:]
        assert torch.allclose(torch.stack(got[r]), want, atol=1e-9), r


def test_graphs_off_when_a_resource_cannot_capture():
    _, kv, _, runner = build(graphs=False)
    free0 = kv.num_free_pages
    runner.warmup()
    assert not runner.enabled
    assert kv.num_free_pages == free0 and kv.sink_page is None  # no graph buffers built for nothing


def test_a_capture_that_fails_half_way_leaves_no_graph_and_runs_eagerly(monkeypatch):
    """A failure while capturing the second graph: the first one is dropped too, the runner stays
    disabled, the dummies are gone, and steps run eagerly."""
    import pytest

    import mstar_core.graphs as graphs_mod

    model, kv, node, runner = build()
    captured = []
    real = graphs_mod.capture_graph

    def second_fails(fn, device):
        if captured:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(fn)
        return real(fn, device)

    monkeypatch.setattr(graphs_mod, "capture_graph", second_fails)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        runner.warmup()
    assert captured and not runner.enabled and runner._graphs == {}
    assert kv.requests == ()
    node.ingest_request("a")
    prep = runner.prepare(Step(KVStep((KVSpan("a", "text", 3),))))
    assert prep.graph is None
    logits = runner.launch(prep, torch.tensor([1, 2, 3]))
    assert torch.allclose(logits[-1], model.forward_full(torch.tensor([1, 2, 3]))[-1], atol=1e-9)


def warm_with_two_prompts():
    """Graphs captured; requests "a" and "b" hold 3 prompt tokens each. Returns (kv, node,
    runner, the decode step of both)."""
    _, kv, node, runner = build()
    runner.warmup()
    for r in ("a", "b"):
        node.ingest_request(r)
    runner.launch(runner.prepare(Step(KVStep((KVSpan("a", "text", 3), KVSpan("b", "text", 3))))),
                  torch.tensor([1, 2, 3, 4, 5, 6]))
    return kv, node, runner, Step(KVStep((KVSpan("a", "text", 1), KVSpan("b", "text", 1))))


def test_a_refused_graph_step_does_not_take_a_slot():
    """Slots alternate between graph steps that run: a refusal in between must not make the
    next step plan into the slot the running step's replay reads."""
    kv, node, runner, decode = warm_with_two_prompts()
    first = runner.prepare(decode)
    assert first.ctx.slot == 0
    runner.launch(first, torch.tensor([1, 2]))
    node.ingest_request("hog")
    hog = node.step(Step(KVStep((KVSpan("hog", "text", 4 * kv.num_free_pages),))), lambda ctx: None)
    assert hog.outcome and kv.num_free_pages == 0
    # "a" is at 4 tokens with page size 4: its next token needs a page, so the step is refused
    refused = runner.prepare(decode)
    assert not refused.outcome and "request 'a'" in refused.outcome.reason()
    node.remove_request("hog")
    second = runner.prepare(decode)
    assert second.outcome and second.ctx.slot == 1


def test_a_decode_step_with_other_mask_parameters_runs_eagerly():
    """A replay reuses the kernel arguments recorded at capture: a step asking for another
    window must not be replayed with the captured one."""
    _, _, runner, decode = warm_with_two_prompts()
    windowed = Step(decode.kv, AttentionStep(window_left=1))
    prep = runner.prepare(windowed)
    assert prep.graph is None and prep.ctx.bucket is None
    runner.launch(prep, torch.tensor([7, 8]))
    assert runner.prepare(Step(windowed.kv)).graph is not None  # the captured parameters replay


def graph_build(graphs=True, buckets=(2, 4)):
    *_, node, runner = tiny_graph_node(graphs, buckets=buckets, layers=1, hidden=32, head_dim=8, seed=5)
    runner.warmup()
    return node, runner


def prompt(node, runner, prompts):
    for r in prompts:
        node.ingest_request(r)
    st = Step(KVStep(tuple(KVSpan(r, "text", len(p)) for r, p in prompts.items())))
    runner.launch(runner.prepare(st), torch.tensor([t for p in prompts.values() for t in p]))


def test_a_decode_step_fills_the_bucket_equal_to_its_rows():
    """A decode step replays in the smallest captured bucket that holds its rows — the bucket
    equal to its row count included — and a step larger than every bucket runs eagerly."""
    node, runner = graph_build(buckets=(2, 4))
    assert [runner.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, None]
    prompt(node, runner, {"a": [1, 2], "b": [3, 4]})
    prep = runner.prepare(Step(KVStep((KVSpan("a", "text", 1), KVSpan("b", "text", 1)))))
    assert prep.graph is not None and prep.ctx.bucket == 2
    runner.discard(prep)


def test_a_decode_step_of_another_label_runs_eagerly():
    """Graphs are captured for one label: a decode step of another label is not replayed
    (it gets no bucket and no graph)."""
    node, runner = graph_build()
    node.ingest_request("a")
    assert node.step(step(("a", "audio", 3)), lambda ctx: None).outcome
    prep = runner.prepare(step(("a", "audio", 1)))
    assert prep.outcome and prep.graph is None and prep.ctx.bucket is None
    runner.discard(prep)


def test_a_decode_step_with_another_sm_scale_is_not_replayed():
    """A replay reuses the kernel arguments recorded at capture, so a decode step whose
    ``sm_scale`` (or causal flag) differs from the captured ones is prepared eagerly — no bucket,
    no graph, its own wrappers — while the same rows with the captured parameters replay."""
    node, runner = graph_build(buckets=(2,))
    prompt(node, runner, {"a": [1, 2, 3], "b": [4, 5]})
    kv_step = KVStep((KVSpan("a", "text", 1), KVSpan("b", "text", 1)))
    for other in (AttentionStep(sm_scale=2.0), AttentionStep(causal=False)):
        prep = runner.prepare(Step(kv_step, other))
        assert prep.outcome and prep.graph is None and prep.ctx.bucket is None, other
        out = runner.launch(prep, torch.tensor([6, 7]))
        assert out.shape[0] == 2 and torch.isfinite(out).all()
    prep = runner.prepare(Step(kv_step))
    assert prep.graph is not None and prep.ctx.bucket == 2
    runner.discard(prep)


def test_discard_all_gives_back_every_prepared_step():
    """A loop cut short with a graph step and an eager step prepared (neither launched): both
    give back their pages and the slot, and the next prepare takes the slot again."""
    _, kv, node, runner = build()
    runner.warmup()
    free0 = kv.num_free_pages
    for r in "abc":
        node.ingest_request(r)
    runner.launch(runner.prepare(Step(KVStep((KVSpan("a", "text", 3), KVSpan("b", "text", 2))))), torch.arange(5))
    held = kv.num_free_pages
    graph = runner.prepare(Step(KVStep((KVSpan("a", "text", 1), KVSpan("b", "text", 1)))))
    eager = runner.prepare(Step(KVStep((KVSpan("c", "text", 9),))))
    assert graph.graph is not None and eager.graph is None and kv.num_free_pages < held
    runner.discard_all()
    assert graph.done and eager.done and runner._pending == {} and runner._open == []
    assert kv.num_free_pages == held and not any(s.in_flight for s in kv.streams.values())
    for r in "abc":
        node.remove_request(r)
    assert kv.num_free_pages == free0


def test_a_failure_on_the_way_into_commit_rolls_the_step_back(monkeypatch):
    """What is raised after the forward and before the commit begins (an interrupt) leaves no
    stream in flight and no page taken: the launch rolls back whatever has not committed."""
    _, kv, node, runner = build()
    runner.warmup()
    free0 = kv.num_free_pages
    node.ingest_request("a")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(node, "commit", interrupted)
    prep = runner.prepare(Step(KVStep((KVSpan("a", "text", 3),))))
    try:
        runner.launch(prep, torch.arange(3))
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupt did not propagate")
    # the stream the admit created is dropped with it
    assert kv.num_free_pages == free0 and kv.streams == {} and runner._open == []


def test_off_cuda_the_log_says_what_a_replay_is(caplog):
    _, _, _, runner = build()
    with caplog.at_level("INFO", logger="mstar_core.graphs"):
        runner.warmup()
    assert "on cpu a replay re-runs the forward; no CUDA graphs" in caplog.text
    assert "CUDA graphs:" not in caplog.text
