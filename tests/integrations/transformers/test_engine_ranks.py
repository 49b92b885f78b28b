"""What a generation loop checks with its peers under tensor parallelism, in one process: rank 0
of two whose collectives answer as a peer would (the same values, or the ones a test gives it).
The ranks agree on the requests before any step, on each step whose rows change, and on the
tokens at the end; unseeded requests draw with rank 0's seeds; a collective that fails inside a
step is a peer's failure. An engine built over that peer refuses a model whose layers do not call
attention with their rank's heads, and checks its cache with the peer once built; in a gloo group of
this process alone, a model sharded by transformers has its shards copied out of whole layers. The
real two-process runs are test_tensor_parallel.py's."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from mstar_core import Engine, EngineOptions, StateError, TensorParallel, TensorParallelError, UnsupportedModel
from mstar_core.integrations.transformers import run
from mstar_core.integrations.transformers.engine import users
from mstar_core.integrations.transformers.parallel import MARK
from mstar_core.sampling import SamplingParams
from mstar_core.testing.hf_models import build

from .test_engine_lifecycle import assert_nothing_held, failing_capture, model_and_reference

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

    def all_reduce(self, x, what="an all-reduce"):
        return x  # the peer's partial sums are not modelled: a model sharded over it runs, with other values


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


def whole_model_over(peer: Peer, **kw) -> Engine:
    """An engine on a fresh tiny Llama that mstar shards over ``peer``'s two ranks."""
    return Engine(build("llama"), "reference", EngineOptions(**{"max_pages": 16, "tp_timeout_s": 1.0, **kw}), tp=peer)


def test_a_model_marked_sharded_whose_layers_still_call_attention_with_every_head_is_refused():
    model = build("llama")
    setattr(model, MARK, Peer(0, 2))  # as if sharded by mstar, but every layer still holds all its heads
    with pytest.raises(UnsupportedModel, match="sharded over 2 ranks calls attention with 8 query / 2 KV heads on "
                                               "rank 0, not its share 4 / 1 of 8 / 2"):
        Engine(model, "reference", EngineOptions(max_pages=16))
    assert users(model) == 0


def test_a_plan_that_leaves_the_attention_whole_is_refused_once_the_model_is_sharded():
    model = build("llama")
    model.tp_plan = {k: v for k, v in model.tp_plan.items() if ".mlp." in k}  # the MLP split, the heads not
    with pytest.raises(UnsupportedModel, match="calls attention with 8 query / 2 KV heads on rank 0, not its share"):
        Engine(model, "reference", EngineOptions(max_pages=16), tp=Peer(0, 2))
    assert users(model) == 0


@pytest.mark.parametrize("graphs", [False, True, "failed"], ids=["eager", "graphs", "capture-failed"])
def test_the_ranks_check_their_caches_agree_once_the_engine_is_built(monkeypatch, graphs):
    if graphs == "failed":  # the steps then run eagerly
        failing_capture(monkeypatch)
    kw = {"graphs": graphs} if isinstance(graphs, bool) else {}
    peer = Peer(0, 2)
    with whole_model_over(peer, max_batch_size=4, **kw) as e:
        assert e.kv.config.num_kv_heads == 1 and e.runner.enabled == (graphs is True)
    assert [what for what, _ in peer.calls] == ["the model's weights", "kv"]
    with pytest.raises(StateError, match="ranks disagree on kv free pages: rank 0 has 1[56], ranks range from -1"):
        whole_model_over(Peer(0, 2, differs={"kv": {"free pages": -1}}), max_batch_size=4, **kw)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone, and its device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("weight", ["view", "own", "replicated"])
def test_a_model_sharded_by_transformers_has_its_shards_copied_out_of_the_whole_layers(one_rank_group, caplog, weight):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    model = build("llama")
    whole = torch.zeros(1024, 256)  # 1 MiB, of which a shard of 32 rows keeps 32 KiB
    local = whole[:32].clone() if weight == "own" else whole[:32]
    placement = Replicate() if weight == "replicated" else Shard(0)
    # A weight as transformers' sharded loading leaves it (its forward never reads it).
    model.loaded = torch.nn.Module()
    model.loaded.weight = torch.nn.Parameter(DTensor.from_local(local, one_rank_group, [placement], run_check=False),
                                             requires_grad=False)
    before = model.loaded.weight
    with caplog.at_level("INFO", logger="mstar_core.integrations.transformers.engine"), \
            Engine(model, "reference", EngineOptions(max_pages=8)) as e:
        sharded = e.tp is not None
    storage = model.loaded.weight.to_local().untyped_storage().nbytes()
    assert sharded == (weight != "replicated")  # only a Shard placement says the model is split over a group
    assert storage == (32 * 256 * 4 if weight != "replicated" else whole.untyped_storage().nbytes())
    assert (model.loaded.weight is before) == (weight != "view")
    copied = "the model's weight shards were views of whole layers (transformers' sharded loading); copied"
    assert (copied in caplog.text) == (weight == "view")
