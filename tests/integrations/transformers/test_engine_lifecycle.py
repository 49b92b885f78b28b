"""An Engine's life on one model: engines that share the model's attention switch, a closed
engine that refuses to run (its cache freed, a step it prepared given back), what it refuses when
built or when a layer calls attention otherwise than when probed, graphs that fall back to eager
steps only where they were not asked for, and a generation loop that leaves nothing held after an
exception at any point of a step (checked against free pages, requests, prepared steps and staging
slots), driven by a hypothesis state machine against transformers' own greedy tokens."""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mstar_core import Engine, EngineOptions, StateError, UnsupportedModel, generate
from mstar_core.integrations.transformers import batching, run
from mstar_core.integrations.transformers.engine import LABEL, users
from mstar_core.step import KVSpan, KVStep, Step
from mstar_core.testing.hf_models import build

from ...helpers import hf_greedy

NEW = 6
LENGTHS = (3, 17, 9, 1)


@functools.cache
def model_and_reference():
    """One tiny Llama, four prompts and transformers' greedy tokens for each (a greedy run of n
    tokens is the first n of a longer one)."""
    model = build("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    return model, prompts, [hf_greedy(model, p, NEW) for p in prompts]


def assert_nothing_held(engine: Engine) -> None:
    # With graphs the KV manager keeps one page for padding rows' writes, for the engine's life.
    assert engine.kv.num_free_pages == engine.options.max_pages - engine.runner.enabled, "pages left held"
    assert engine.kv.requests == (), "requests left in the cache"
    assert engine.runner._pending == {}, "a staging slot still holds a prepared step"
    assert engine.runner._open == [], "a prepared step was neither launched nor discarded"
    assert not any(s.in_flight for s in engine.kv.streams.values())
    if engine.sampler is not None:
        assert sorted(engine.sampler._free) == list(range(engine.sampler.pad)), "sampler slots left held"


class Injected(Exception):
    """A host-side failure inside a step."""


POINTS = ("prepare", "plan", "tokens", "launch", "forward", "commit", "write_kv", "read", "on_step")


@contextmanager
def fault(engine: Engine, point: str, at: int, kind: type[BaseException]):
    """Raise ``kind`` at the ``at``-th call of ``point`` in the generation loop (on the way in:
    the call does not happen)."""
    calls = {"n": 0}

    def trip() -> None:
        calls["n"] += 1
        if calls["n"] == at:
            raise kind("injected at " + point)

    def wrap(fn):
        def wrapped(*a, **kw):
            trip()
            return fn(*a, **kw)
        return wrapped

    targets = {"prepare": (engine.runner, "prepare"), "plan": (engine.node, "plan"),
               "launch": (engine.runner, "launch"), "forward": (engine.runner, "forward"),
               "commit": (engine.node, "commit"),
               "write_kv": (engine.kv, "write_kv"), "tokens": (batching._Loop, "_tokens"),
               "read": (batching._Loop, "_read")}
    if point == "on_step":
        yield lambda done, total: trip()
        return
    obj, name = targets[point]
    had, before = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, wrap(getattr(obj, name)))
    try:
        yield None
    finally:
        if had:
            setattr(obj, name, before)
        else:
            delattr(obj, name)  # the class's method shows again


def test_two_engines_on_one_model_share_its_switch():
    model, prompts, want = model_and_reference()
    a = Engine(model, "reference", EngineOptions(max_pages=16))
    b = Engine(model, "reference", EngineOptions(max_pages=16, graphs=True, max_batch_size=4))
    assert users(model) == 2
    a.close()  # the other engine still runs through mstar
    assert model.config._attn_implementation == "mstar"
    assert run(b, prompts[:2], NEW).ids == want[:2]
    b.close()
    assert model.config._attn_implementation == "eager" and users(model) == 0



@pytest.mark.parametrize("before, after", [("sdpa", "sdpa"), (None, "eager")], ids=["sdpa", "unset"])
def test_the_last_engine_to_close_switches_the_model_back_to_what_it_had(before, after):
    model = build("llama")
    model.set_attn_implementation("sdpa")
    model.config._attn_implementation = before  # None: a config that names none runs eager
    Engine(model, "reference", EngineOptions(max_pages=8)).close()
    assert model.config._attn_implementation == after and users(model) == 0


def test_a_model_switched_away_before_close_stays_as_the_caller_switched_it():
    model = build("llama")
    with Engine(model, "reference", EngineOptions(max_pages=8)):
        model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa" and users(model) == 0


def test_the_engine_serves_through_mstars_attention_even_after_the_name_was_taken():
    from transformers import AttentionInterface

    from mstar_core.integrations.transformers.attention import register

    def other(*args, **kwargs):
        raise AssertionError("another function registered under 'mstar' ran")

    model, prompts, want = model_and_reference()
    AttentionInterface.register("mstar", other)
    try:
        assert generate(model, prompts[:1], 3, backend="reference") == [want[0][:3]]
    finally:
        register()


@pytest.mark.parametrize("how", ["raises", "ignores"])
def test_a_model_that_does_not_take_the_switch_is_refused_and_left_as_it_was(monkeypatch, how):
    model = build("llama")

    def refuse(name):
        if how == "raises":
            raise ValueError(f"{name} is not supported")
        # transformers only warns for a class it cannot switch, and changes nothing

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    match = ("does not take a custom attention implementation: mstar is not supported" if how == "raises" else
             "did not switch to attn_implementation 'mstar'")
    with pytest.raises(UnsupportedModel, match=match):
        Engine(model, "reference", EngineOptions(max_pages=8))
    assert model.config._attn_implementation == "eager" and users(model) == 0


def test_closing_one_engine_twice_gives_back_its_share_of_the_switch_once():
    model = build("llama")
    a, b = (Engine(model, "reference", EngineOptions(max_pages=8)) for _ in range(2))
    a.close()
    a.close()
    assert users(model) == 1 and model.config._attn_implementation == "mstar"  # b still runs through mstar
    b.close()
    assert users(model) == 0 and model.config._attn_implementation == "eager"

def test_concurrent_generate_calls_on_one_model():
    model, prompts, want = model_and_reference()
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def serve(i: int) -> None:
        try:
            got[i] = generate(model, prompts[i:i + 2], NEW, backend="reference")
        except BaseException as e:  # reported below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(i,)) for i in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == {0: want[0:2], 2: want[2:4]}
    assert model.config._attn_implementation == "eager" and users(model) == 0


def test_a_closed_engine_refuses_to_run():
    model, prompts, _ = model_and_reference()
    engine = Engine(model, "reference", EngineOptions(max_pages=16))
    engine.close()
    engine.close()  # twice: nothing more to do
    with pytest.raises(StateError, match="Engine is closed"):
        run(engine, prompts[:1], 2)
    with pytest.raises(StateError, match="Engine is closed"):  # said first, before any input is read
        run(engine, prompts[:1], 0)
    with pytest.raises(StateError, match="Engine is closed"):  # generate's path: inputs checked before
        batching.run_checked(engine, prompts[:1], 2, [0], set(), None)
    assert users(model) == 0 and model.config._attn_implementation == "eager"
    assert engine.kv.storage.numel() == 0, "the KV cache was not freed"


def test_closing_an_engine_gives_back_a_step_it_prepared_and_never_launched():
    model, prompts, _ = model_and_reference()
    engine = Engine(model, "reference", EngineOptions(max_pages=16))
    engine.node.ingest_request("a")
    prep = engine.runner.prepare(Step(KVStep((KVSpan("a", LABEL, 3),)), engine.step_attn))
    engine.close()
    assert prep.done and engine.runner._open == []
    with pytest.raises(StateError, match="launch of a step that was already launched or discarded"):
        engine.runner.launch(prep, torch.tensor(prompts[0]))


def test_an_encoder_decoder_model_is_refused_before_its_attention_is_switched(monkeypatch):
    model = build("llama")
    monkeypatch.setattr(model.config, "is_encoder_decoder", True, raising=False)
    switched = []
    monkeypatch.setattr(model, "set_attn_implementation", switched.append)
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM is an encoder-decoder model"):
        Engine(model, "reference", EngineOptions(max_pages=8))
    assert switched == [] and users(model) == 0


def _masked(attn) -> None:
    """``attn`` passes an attention mask of its own (as a model that builds its mask itself)."""
    forward = attn.forward

    def with_mask(*a, **kw):
        kw["attention_mask"] = torch.zeros(1, 1, 1, 1)
        return forward(*a, **kw)

    attn.forward = with_mask


@pytest.mark.parametrize("change, says", [
    ("scaling", r"layer 1 called attention with \(sm_scale, window_left, soft_cap, sinks\) = \(0\.25, -1, None, "
                r"False\); the engine was built for \(0\.125, -1, None, False\)"),
    ("mask", r"layer 1 called attention with .* = \(0\.125, -1, None, False\) and a mask; the engine was built for"),
], ids=["scaling", "mask"])
def test_a_layer_that_calls_attention_otherwise_than_when_probed_is_refused(change, says):
    model = build("llama")
    with Engine(model, "reference", EngineOptions(max_pages=8)) as engine:
        attn = model.model.layers[1].self_attn
        if change == "scaling":
            attn.scaling *= 2
        else:
            _masked(attn)
        with pytest.raises(UnsupportedModel, match=says + r".*must not change after the model is probed"):
            run(engine, [[1, 2, 3]], 2)
        assert_nothing_held(engine)


def failing_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs by default (as on CUDA), and a capture that fails (as a forward with a host sync does)."""
    import mstar_core.integrations.transformers.engine as engine_mod
    from mstar_core.graphs import GraphRunner

    def host_sync(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine_mod, "graphs_default", lambda device: True)
    monkeypatch.setattr(GraphRunner, "warmup", host_sync)


def _refused(model, opts, error, match):
    """Building the engine raises ``error`` and leaves the model with no user."""
    with pytest.raises(error, match=match):
        Engine(model, "reference", opts)
    assert users(model) == 0


def _eager_warnings(model, opts, prompts, want, caplog) -> str:
    """The engine runs without graphs and gives the reference's ids for two prompts; the warnings."""
    with caplog.at_level("WARNING"), Engine(model, "reference", opts) as engine:
        assert not engine.runner.enabled
        assert run(engine, prompts[:2], NEW).ids == want[:2]
    return caplog.text


@pytest.mark.parametrize("asked", [{}, {"graphs": True}, {"compile": True}], ids=["default", "graphs", "compile"])
def test_a_failed_capture_runs_eagerly_only_where_graphs_were_not_asked_for(monkeypatch, caplog, asked):
    failing_capture(monkeypatch)
    model, prompts, want = model_and_reference()
    opts = EngineOptions(max_pages=16, max_batch_size=4, **asked)
    if asked:
        _refused(model, opts, RuntimeError, "stream is capturing")
        return
    warned = _eager_warnings(model, opts, prompts, want, caplog)
    assert "graphs off: capturing LlamaForCausalLM's decode step failed (RuntimeError: operation not" in warned


@pytest.mark.parametrize("compile", [True, None])
def test_compile_where_the_backend_cannot_capture_is_refused_or_runs_eagerly(monkeypatch, caplog, compile):
    from mstar_core.attention.paged import PagedAttentionManager
    from mstar_core.compiling import CompileError

    monkeypatch.setattr(PagedAttentionManager, "can_capture", lambda self: False)
    model, prompts, want = model_and_reference()
    opts = EngineOptions(max_pages=16, max_batch_size=4, compile=compile, compile_backend="eager")
    if compile:
        _refused(model, opts, CompileError, "compile=True: backend reference cannot capture paged decode here")
        return
    warned = _eager_warnings(model, opts, prompts, want, caplog)
    assert "graphs requested but backend reference cannot capture paged decode here: steps run eagerly, uncompiled" \
        in warned


def test_a_model_switched_away_under_an_open_engine_is_refused():
    model, prompts, _ = model_and_reference()
    with Engine(model, "reference", EngineOptions(max_pages=16)) as engine:
        model.set_attn_implementation("sdpa")
        try:
            with pytest.raises(StateError, match="switched to attn_implementation 'sdpa'"):
                run(engine, prompts[:1], 2)
            assert_nothing_held(engine)
        finally:
            model.set_attn_implementation("mstar")
    assert model.config._attn_implementation == "eager"


def test_a_model_switched_away_between_compiled_graph_steps_is_refused():
    model = build("llama")
    opts = EngineOptions(max_pages=8, max_batch_size=1, compile=True, compile_backend="eager")

    def switch_away(done: int, total: int) -> None:
        if done == 1:  # after the prompt's step: the next is a compiled graph step
            model.set_attn_implementation("sdpa")

    with Engine(model, "reference", opts) as engine:
        assert engine.runner.enabled and engine.runner.compiler is not None
        try:
            with pytest.raises(StateError, match="switched to attn_implementation 'sdpa'"):
                run(engine, [[1, 2, 3]], 4, on_step=switch_away)
            assert_nothing_held(engine)
        finally:
            model.set_attn_implementation("mstar")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kind", [KeyboardInterrupt, Injected])
@pytest.mark.parametrize("sampler", [None, ()], ids=["argmax", "sampler"])
def test_an_interrupt_between_prepare_and_launch_leaves_nothing_held(graphs, kind, sampler):
    model, prompts, want = model_and_reference()
    opts = EngineOptions(max_pages=16, graphs=graphs, max_batch_size=4, sampler=sampler)
    with Engine(model, "reference", opts) as engine:
        with fault(engine, "tokens", 3, kind), pytest.raises(kind, match="injected at tokens"):
            run(engine, prompts[:3], NEW)
        assert_nothing_held(engine)
        assert run(engine, prompts[:3], NEW).ids == want[:3]  # every later run is served, correctly


class EngineLife(RuleBasedStateMachine):
    """At most two engines open on one model; runs with a failure injected at some call of some
    point of a step, or none; closes; runs on closed engines."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.prompts, self.want = model_and_reference()
        self.engines: list[Engine] = []
        self.closed: list[Engine] = []

    @precondition(lambda self: len(self.engines) < 2)
    @rule(graphs=st.booleans(), pages=st.integers(6, 24))
    def open_engine(self, graphs: bool, pages: int) -> None:
        self.engines.append(Engine(self.model, "reference", EngineOptions(max_pages=pages, graphs=graphs,
                                                                          max_batch_size=4)))

    @precondition(lambda self: self.engines)
    @rule(which=st.integers(0, 1), chosen=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
          new=st.integers(1, NEW), point=st.sampled_from((None, *POINTS)), at=st.integers(1, 6),
          kind=st.sampled_from((KeyboardInterrupt, Injected)), arrivals=st.booleans())
    def generate(self, which, chosen, new, point, at, kind, arrivals) -> None:
        engine = self.engines[which % len(self.engines)]
        prompts = [self.prompts[i] for i in chosen]
        arr = list(range(len(chosen))) if arrivals else None
        # A prompt set that cannot fit the cache at all is refused up front (and holds nothing).
        fits = all((len(p) + new + 15) // 16 <= engine.options.max_pages for p in prompts)
        if point is None:
            if not fits:
                with pytest.raises(ValueError, match="raise max_pages"):
                    run(engine, prompts, new, arrivals=arr)
                return
            assert run(engine, prompts, new, arrivals=arr).ids == [self.want[i][:new] for i in chosen]
            return
        with fault(engine, point, at, kind) as on_step:
            try:
                out = run(engine, prompts, new, arrivals=arr, on_step=on_step)
            except ValueError:
                assert not fits
                return
            except BaseException as e:
                # The injected failure, or a CommitError that carries it.
                assert isinstance(e, kind) or isinstance(e.__cause__, kind), repr(e)
                return
        # The point was not reached that many times: the run is whole, and right.
        assert out.ids == [self.want[i][:new] for i in chosen]

    @precondition(lambda self: self.engines)
    @rule(which=st.integers(0, 1))
    def close(self, which: int) -> None:
        engine = self.engines.pop(which % len(self.engines))
        engine.close()
        self.closed.append(engine)

    @precondition(lambda self: self.closed)
    @rule()
    def run_closed(self) -> None:
        with pytest.raises(StateError, match="Engine is closed"):
            run(self.closed[-1], self.prompts[:1], 1)

    @invariant()
    def nothing_held(self) -> None:
        for engine in self.engines:
            assert_nothing_held(engine)
        assert users(self.model) == len(self.engines)
        assert self.model.config._attn_implementation == ("mstar" if self.engines else "eager")

    def teardown(self) -> None:
        for engine in self.engines:
            engine.close()
        assert self.model.config._attn_implementation == "eager"


TestEngineLife = EngineLife.TestCase
# MSTAR_STATE_EXAMPLES: more examples for a longer search than CI's.
TestEngineLife.settings = settings(max_examples=int(os.environ.get("MSTAR_STATE_EXAMPLES", 25)), stateful_step_count=8,
                                   deadline=None, suppress_health_check=[HealthCheck.too_slow])
