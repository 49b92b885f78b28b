"""What a generation loop checks with its peers under tensor parallelism, in one process: rank 0
of two whose collectives answer as a peer would (the same values, or the ones a test gives it).
The ranks agree on the requests before any step, on each step whose rows change, and on the
tokens at the end; unseeded requests draw with rank 0's seeds; a collective that fails inside a
step is a peer's failure. The real two-process runs are test_tensor_parallel.py's."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mstar_core import Engine, EngineOptions, StateError, TensorParallel, TensorParallelError
from mstar_core.integrations.transformers import run
from mstar_core.sampling import SamplingParams

from .test_engine_lifecycle import assert_nothing_held, model_and_reference

GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"


@dataclass(frozen=True)
class Peer(TensorParallel):
    """Rank 0 of two. Its peer holds the same values for every check but those ``differs`` gives
    (check -> name -> the peer's value); rank 0's broadcast gives ``seeds`` where set. ``calls``:
    every check and broadcast, in order."""

    differs: dict[str, dict[str, int]] = field(default_factory=dict)
    seeds: tuple[int, ...] | None = None
    calls: list[tuple[str, object]] = field(default_factory=list)

    def ranges(self, what, values):
        self.calls.append((what, dict(values)))
        peer = {**values, **self.differs.get(what, {})}
        return {k: (min(v, peer[k]), max(v, peer[k])) for k, v in values.items()}

    def broadcast(self, values, what):
        self.calls.append((what, list(values)))
        return list(values if self.seeds is None else self.seeds)


def engine(peer: Peer | None, **kw) -> Engine:
    model, _, _ = model_and_reference()
    e = Engine(model, "reference", EngineOptions(**{"max_pages": 16, "tp_timeout_s": 1.0, **kw}))
    e.tp = peer  # what the loop runs over; the cache and model are one rank's either way
    return e


def test_the_ranks_check_the_requests_each_step_whose_rows_change_and_the_tokens():
    _, prompts, want = model_and_reference()
    two = prompts[:2]
    for stop in (None, lambda i, ids: False):
        peer = Peer(0, 2)
        with engine(peer) as e:
            out = run(e, two, 4, eos_token_id=None, stop=stop)
        assert out.ids == [w[:4] for w in want[:2]]
        # step 0 prefills both, step 1 decodes both; steps 2 and 3 decode the same rows
        assert [what for what, _ in peer.calls] == ["the requests", "the broadcast of the request seeds",
                                                    "step 0's admission", "step 1's admission", "the generated tokens"]
        requests, _, step0, step1, tokens = (values for _, values in peer.calls)
        assert requests["max_new_tokens"] == 4 and requests["stop"] == (stop is not None)
        assert (step0["rows"], step0["tokens"], step1["rows"], step1["tokens"]) == (2, len(two[0]) + len(two[1]), 2, 2)
        assert tokens["count"] == 8


@pytest.mark.parametrize("what, name, says", [
    ("the requests", "prompts", "every rank must generate for the same prompts"),
    ("step 1's admission", "rows", "admission decisions have diverged"),
    ("the generated tokens", "checksum", "the ranks computed different tokens"),
])
def test_a_rank_that_disagrees_with_its_peer_is_refused_naming_what(what, name, says):
    _, prompts, _ = model_and_reference()
    peer = Peer(0, 2, differs={what: {name: -1}})
    with engine(peer) as e:
        with pytest.raises(StateError, match=rf"ranks disagree on {what} {name}: rank 0 has \d+, .*; {says}"):
            run(e, prompts[:2], 4)
        assert_nothing_held(e)


@pytest.mark.parametrize("seeds, broadcast", [((None, None), True), ((None, 5), True), ((3, 5), False)])
def test_unseeded_requests_draw_with_rank_0s_seeds(seeds, broadcast):
    _, prompts, _ = model_and_reference()
    given = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    peer = Peer(0, 2, seeds=(11, 12))
    with engine(peer, sampler=()) as e:
        got = run(e, prompts[:2], 4, sampling=given).ids
    # rank 0's seeds replace every request's where any is unseeded (a seed given is rank 0's too)
    used = (11, 12) if broadcast else seeds
    with engine(None, sampler=()) as e:
        assert got == run(e, prompts[:2], 4, sampling=[SamplingParams(temperature=1.0, seed=s) for s in used]).ids
    sent = [v for what, v in peer.calls if what == "the broadcast of the request seeds"]
    assert len(sent) == broadcast and all(v[1] == seeds[1] for v in sent if seeds[1] is not None)


def failing_launch(e: Engine, monkeypatch: pytest.MonkeyPatch, error: Exception, at: int) -> None:
    """The runner's ``at``-th launch raises ``error`` (as a layer's collective would)."""
    launch, calls = e.runner.launch, []

    def spy(prep, tokens):
        calls.append(1)
        if len(calls) == at:
            raise error
        return launch(prep, tokens)

    monkeypatch.setattr(e.runner, "launch", spy)


@pytest.mark.parametrize("peer, error, raised", [
    (True, RuntimeError(GLOO), TensorParallelError),  # the peer failed: said so, naming the step
    (True, RuntimeError("CUDA out of memory"), RuntimeError),  # this rank's own failure stands
    (False, RuntimeError(GLOO), RuntimeError),  # one process: nothing to blame on a peer
])
def test_a_collective_that_fails_inside_a_step_is_a_peers_failure(monkeypatch, peer, error, raised):
    _, prompts, _ = model_and_reference()
    with engine(Peer(0, 2) if peer else None) as e:
        failing_launch(e, monkeypatch, error, at=2)
        with pytest.raises(RuntimeError) as got:
            run(e, prompts[:2], 4)
        assert type(got.value) is raised
        if raised is TensorParallelError:
            assert str(got.value).startswith("rank 0: step 1 failed (RuntimeError: [/pytorch/third_party/gloo/")
            assert got.value.__cause__ is error
        else:
            assert got.value is error
        assert_nothing_held(e)
