"""What ``generate``, ``run`` and ``Engine`` take where their inputs enter: ints are ints (never
rounded or parsed), end-of-sequence ids in every form a config holds them, a model that is not a
transformers model named as such; every refusal names the bad value and leaves the model and the
engine holding nothing. And a model real checkpoints ship (a sliding window longer than the cache
a short run needs) is served, not refused."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mstar_core import Engine, EngineOptions, generate
from mstar_core.integrations.transformers import run, run_checked
from mstar_core.integrations.transformers.engine import graphs_default, users
from mstar_core.testing.hf_models import build

from ...helpers import hf_greedy
from .test_engine_lifecycle import assert_nothing_held, model_and_reference


def untouched(model) -> None:
    assert model.config._attn_implementation == "eager" and users(model) == 0


# (id, keyword arguments of generate besides the model, error type, what the message must name)
CASES = [
    ("prompt-float-id", dict(prompts=[[1, 1.9]]), TypeError, r"prompts\[0\] holds 1\.9 \(float\)"),
    ("prompt-str-id", dict(prompts=[["1"]]), TypeError, r"'1' \(str\)"),
    ("prompt-bool-id", dict(prompts=[[2], [True]]), TypeError, r"prompts\[1\] holds True \(bool\)"),
    ("prompt-float-tensor", dict(prompts=[torch.tensor([1.0, 2.0])]), TypeError, r"1\.0 \(float\)"),
    ("eos-str", dict(eos_token_id="5"), TypeError, r"eos_token_id must be None, an int or a list of ints, got '5'"),
    ("eos-list-with-str", dict(eos_token_id=[3, "5"]), TypeError, r"\[3, '5'\]"),
    ("eos-float-tensor", dict(eos_token_id=torch.tensor(5.0)), TypeError, r"torch\.float32 tensor"),
    ("eos-outside-vocab", dict(eos_token_id=999), ValueError,
     r"eos_token_id \[999\] outside the vocabulary \(ids 0\.\.127\)"),
    ("eos-negative", dict(eos_token_id=[-1]), ValueError, r"\[-1\]"),
    ("arrivals-float", dict(arrivals=[0.5]), ValueError, r"\[0\.5\]"),
    ("arrivals-str", dict(arrivals="0"), ValueError, r"got '0'"),
    ("max-new-float", dict(max_new_tokens=2.0), ValueError, r"max_new_tokens must be an int >= 1, got 2\.0"),
    ("max-new-bool", dict(max_new_tokens=True), ValueError, r"got True"),
    ("on-step-not-callable", dict(on_step=5), TypeError, r"on_step must be a callable .* got 5"),
    ("stop-not-callable", dict(stop=5), TypeError, r"stop must be a callable stop\(index, ids\) .* got 5"),
    ("new-past-positions", dict(max_new_tokens=2048), ValueError,
     r"prompts\[0\] \(3 tokens\) \+ max_new_tokens 2048 = 2051 positions, more than the model's max_position_emb"),
    ("prompt-past-step-budget", dict(max_prefill_tokens=2), ValueError,
     r"prompt 0 has 3 tokens, more than max_prefill_tokens 2 \(one step's prompt tokens\)"),
    ("prompt-float-array", dict(prompts=[np.array([1.5])]), TypeError, r"1\.5 \(float\)"),
    ("prompts-a-str", dict(prompts="hello"), ValueError, r"got 'hello'"),
    ("buckets-an-int", dict(buckets=4, graphs=True), TypeError, r"buckets must be a sequence .* got int 4"),
    ("buckets-a-mapping", dict(buckets={4: "x"}, graphs=True), TypeError, r"buckets must be a sequence .* got dict"),
    ("graphs-without-room", dict(max_pages=3, graphs=True, max_batch_size=4), ValueError,
     r"up to 4 rows .* max_pages is 3"),
]


# The cases of run's own inputs (the rest are engine options).
RUN_CASES = [c for c in CASES if not {"buckets", "max_pages", "max_prefill_tokens"} & set(c[1])]


@pytest.mark.parametrize("name, kw, error, match", CASES, ids=[c[0] for c in CASES])
def test_generate_refuses_naming_the_value(name, kw, error, match):
    model, prompts, _ = model_and_reference()
    kw = {"prompts": prompts[:1], "max_new_tokens": 2, **kw}
    with pytest.raises(error, match=match):
        generate(model, backend="reference", **kw)
    untouched(model)


@pytest.mark.parametrize("name, kw, error, match", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_run_refuses_naming_the_value_and_holds_nothing(name, kw, error, match):
    model, prompts, _ = model_and_reference()
    kw = {"prompts": prompts[:1], "max_new_tokens": 2, **kw}
    with Engine(model, "reference", EngineOptions(max_pages=8)) as engine:
        with pytest.raises(error, match=match):
            run(engine, kw.pop("prompts"), kw.pop("max_new_tokens"), **kw)
        assert_nothing_held(engine)
    untouched(model)


EOS_FORMS = {"numpy-int": np.int64, "0-d-tensor": torch.tensor, "1-d-tensor": lambda t: torch.tensor([t]),
             "list-of-numpy": lambda t: [np.int32(t)], "tuple": lambda t: (t,), "set": lambda t: {t},
             "numpy-array": lambda t: np.array([t])}


@pytest.mark.parametrize("form", list(EOS_FORMS))
def test_end_of_sequence_ids_in_every_form_a_config_holds_them(form):
    model, prompts, want = model_and_reference()
    stop = want[1][2]  # the third token of prompt 1: the run must stop right there
    got = generate(model, prompts[1:2], 6, backend="reference", eos_token_id=EOS_FORMS[form](stop))
    assert got == [hf_greedy(model, prompts[1], 6, eos_token_id=stop)]
    assert got[0][-1] == stop and len(got[0]) <= 3


@pytest.mark.parametrize("thing", [torch.nn.Linear(2, 2), object(), "meta-llama/Llama-3-8B"],
                         ids=["module", "object", "model-name"])
def test_what_is_not_a_transformers_model_is_named_as_such(thing):
    with pytest.raises(TypeError, match="is not a transformers model"):
        generate(thing, [[1, 2]], 2)
    with pytest.raises(TypeError, match="is not a transformers model"):
        Engine(thing, "reference", EngineOptions(max_pages=4))


@pytest.mark.parametrize("form", ["2-d-tensor", "numpy-rows", "tensor-rows", "tuples"])
def test_prompts_as_tensors_and_arrays(form):
    model, prompts, want = model_and_reference()
    two = [prompts[0], prompts[2][:3]]  # both 3 tokens: a 2-D tensor holds them
    given = {"2-d-tensor": torch.tensor(two), "numpy-rows": [np.array(p) for p in two],
             "tensor-rows": [torch.tensor(p) for p in two], "tuples": tuple(tuple(p) for p in two)}[form]
    assert generate(model, given, 3, backend="reference") == generate(model, two, 3, backend="reference")
    assert generate(model, given, 3, backend="reference")[0] == want[0][:3]


def test_engine_options_of_another_type_are_refused():
    model, _, _ = model_and_reference()
    with pytest.raises(TypeError, match="options must be an EngineOptions, got dict"):
        Engine(model, "reference", {"max_pages": 4})
    untouched(model)


def test_a_sliding_window_longer_than_the_cache_is_served_as_full_attention(caplog):
    """A Mistral-7B-style 4096-token window over a cache sized for two short prompts: no token is
    ever 4096 back, so every layer is full attention, as transformers' own greedy run says."""
    model = build("mistral", sliding_window=4096)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 12)]
    with caplog.at_level("INFO", logger="mstar_core.attention.paged"):
        got = generate(model, prompts, 8, backend="reference")
    assert got == [hf_greedy(model, p, 8) for p in prompts]
    assert "reach past the KV cache" in caplog.text
    untouched(model)


def test_graphs_by_default_without_room_for_the_widest_bucket_run_eagerly(monkeypatch, caplog):
    import mstar_core.integrations.transformers.engine as engine_mod

    monkeypatch.setattr(engine_mod, "graphs_default", lambda device: True)  # as on CUDA
    model, prompts, want = model_and_reference()
    with caplog.at_level("WARNING"), Engine(model, "reference", EngineOptions(max_pages=4, max_batch_size=4)) as e:
        assert not e.runner.enabled
        assert run(e, prompts[:1], 4).ids == [want[0][:4]]
    assert "graphs off: graphs capture batches of up to 4 rows" in caplog.text and "max_pages is 4" in caplog.text


@pytest.mark.parametrize("asked", [{"graphs": True}, {"compile": True}], ids=["graphs", "compile"])
def test_graphs_asked_for_without_room_for_the_widest_bucket_are_refused(asked):
    model, _, _ = model_and_reference()
    with pytest.raises(ValueError, match=r"Engine: graphs capture batches of up to 4 rows .* but max_pages is 4; "
                                         r"raise max_pages, lower max_batch_size or buckets, or set graphs=False"):
        Engine(model, "reference", EngineOptions(max_pages=4, max_batch_size=4, **asked))
    untouched(model)


@pytest.mark.parametrize("graphs", [False, None], ids=["off", "cpu-default"])
def test_an_engine_without_graphs_says_nothing_of_the_widest_bucket(caplog, graphs):
    model, prompts, want = model_and_reference()
    with caplog.at_level("WARNING"), Engine(model, "reference", EngineOptions(max_pages=2, max_batch_size=4,
                                                                              graphs=graphs)) as e:
        assert run(e, prompts[:1], 4).ids == [want[0][:4]]
    assert "graphs off" not in caplog.text


def test_new_tokens_past_the_models_positions_are_refused_naming_the_bound(monkeypatch):
    model, prompts, _ = model_and_reference()
    limit = model.config.max_position_embeddings
    built = []
    monkeypatch.setattr(Engine, "__init__", lambda *a, **k: built.append(1))  # must not be reached
    with pytest.raises(ValueError, match=rf"prompts\[1\] \(3 tokens\) \+ max_new_tokens {limit} = {limit + 3} "
                                         rf"positions, more than the model's max_position_embeddings {limit}: "
                                         rf"lower max_new_tokens to at most {limit - 3}"):
        generate(model, [[1, 2], [1, 2, 3]], limit, backend="reference")
    assert built == []
    untouched(model)


def test_a_cache_larger_than_memory_is_refused_before_it_is_allocated(monkeypatch):
    import mstar_core.memory as memory

    model, prompts, _ = model_and_reference()
    monkeypatch.setattr(model.config, "max_position_embeddings", 2 * 10**9)  # a context longer than memory holds
    monkeypatch.setattr(memory, "available_bytes", lambda device: 16 << 30)  # any machine's, not this one's
    with pytest.raises(ValueError, match=r"Engine: the KV cache of max_pages 62500002 x page_size 16 .* max_new_tokens"
                                         r".* needs about 3\.7 TiB, more than the 16\.0 GiB available on cpu"):
        generate(model, [[1, 2]], 10**9, backend="reference")
    untouched(model)
    # What fits is served: the check reads the free memory, not a fixed bound.
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 << 20)
    with pytest.raises(ValueError, match=r"max_pages 4097 .* more than the 8\.0 MiB available"):
        Engine(model, "reference", EngineOptions(max_pages=4097))
    with Engine(model, "reference", EngineOptions(max_pages=8)) as engine:
        assert run(engine, prompts[:1], 2).ids
    untouched(model)


def test_arrivals_and_buckets_as_numpy_arrays():
    model, prompts, want = model_and_reference()
    got = generate(model, prompts[:2], 4, backend="reference", arrivals=np.array([0, 2]),
                   buckets=np.array([1, 2]), graphs=True)
    assert got == [w[:4] for w in want[:2]]


def test_a_model_eos_outside_its_vocabulary_is_ignored_with_a_warning(caplog):
    """A config may list an id the model cannot produce: it never matches, so it is dropped with
    a warning; a caller's own such id is refused (the table above)."""
    model, prompts, want = model_and_reference()
    model.generation_config.eos_token_id = [500]
    try:
        with caplog.at_level("WARNING"):
            assert generate(model, prompts[:1], 4, backend="reference") == [want[0][:4]]
    finally:
        model.generation_config.eos_token_id = None
    assert "end-of-sequence ids [500] outside its vocabulary of 128" in caplog.text


def test_buckets_wider_than_the_batch_are_the_batch():
    assert EngineOptions(max_pages=8, max_batch_size=7, buckets=(1, 2, 4, 8)).graph_buckets() == [1, 2, 4, 7]



@pytest.mark.parametrize("batch", [1, 2, 5, 8, 64])
def test_default_buckets_are_the_powers_of_two_below_the_batch_and_the_batch(batch):
    want = [2**i for i in range(batch.bit_length()) if 2**i < batch] + [batch]
    assert EngineOptions(max_batch_size=batch).graph_buckets() == want


def test_graphs_are_on_by_default_only_on_cuda():
    assert graphs_default(torch.device("cuda")) and not graphs_default(torch.device("cpu"))
    model, prompts, want = model_and_reference()
    with Engine(model, "reference", EngineOptions(max_pages=8, max_batch_size=2)) as engine:
        assert not engine.runner.enabled  # on this CPU every step runs eagerly
        assert run(engine, prompts[:1], 3).ids == [want[0][:3]]


@pytest.mark.parametrize("lacks", ["config", "set_attn_implementation"])
def test_a_model_lacking_config_or_the_switch_is_not_a_transformers_model(lacks):
    class Half:
        config = SimpleNamespace(vocab_size=8) if lacks != "config" else None

        def set_attn_implementation(self, name):
            pass

    if lacks == "set_attn_implementation":
        Half.set_attn_implementation = None  # type: ignore[assignment,method-assign]
    with pytest.raises(TypeError, match="Half is not a transformers model"):
        Engine(Half(), "reference", EngineOptions(max_pages=4))

def test_checked_inputs_without_sampling_are_served_greedily():
    model, prompts, want = model_and_reference()
    with Engine(model, "reference", EngineOptions(max_pages=8)) as engine:
        assert run_checked(engine, prompts[:2], 4, [0, 0], set(), None).ids == [w[:4] for w in want[:2]]


# Each size option's two ways to be wrong: an int below 1, and a number that is not an int.
SIZES = [(name, bad) for name in ("page_size", "max_batch_size", "max_prefill_tokens", "max_pages") for bad in (0, 2.5)]


@pytest.mark.parametrize("name, bad", SIZES, ids=[f"{n}-{b}" for n, b in SIZES])
def test_engine_sizes_are_ints_of_at_least_one(name, bad):
    with pytest.raises(ValueError, match=rf"mstar generate: {name} must be an int >= 1.*got {bad}"):
        EngineOptions(**{name: bad})
    o = EngineOptions(page_size=1, max_batch_size=1, max_prefill_tokens=1, max_pages=1)  # the least of each
    assert (o.page_size, o.max_batch_size, o.max_prefill_tokens, o.max_pages) == (1, 1, 1, 1)
    d = EngineOptions()
    assert (d.page_size, d.max_batch_size, d.max_prefill_tokens, d.max_pages) == (16, 64, 8192, None)


# (id, EngineOptions' keyword arguments, error type, what the message must name)
OPTIONS = [
    ("graphs-a-str", dict(graphs="yes"), TypeError, r"graphs must be a bool or None .* got 'yes'"),
    ("compile-a-str", dict(compile="yes"), TypeError, r"compile must be True, False or None .* got 'yes'"),
    ("sampler-a-str", dict(sampler="top_k"), ValueError, r"sampler must be None \(greedy\) or filters .* got 'top_k'"),
    ("sampler-an-int", dict(sampler=5), ValueError, r"sampler must be None .* got 5"),
    ("sampler-a-mapping", dict(sampler={"top_k": 50}), ValueError, r"sampler must be None .* got \{'top_k': 50\}"),
    ("sampler-unknown-filter", dict(sampler=("top_k", "beam")), ValueError, r"sampler must be None .* 'beam'"),
    ("tp-timeout-zero", dict(tp_timeout_s=0), ValueError, r"tp_timeout_s must be a finite number .* > 0, got 0"),
    ("tp-timeout-inf", dict(tp_timeout_s=float("inf")), ValueError, r"tp_timeout_s .* got inf"),
    ("compile-without-graphs", dict(compile=True, graphs=False), ValueError, r"compile compiles the graph steps"),
    ("maybe-compile-without-graphs", dict(compile=None, graphs=False), ValueError, r"but graphs is False"),
]


@pytest.mark.parametrize("name, kw, error, match", OPTIONS, ids=[c[0] for c in OPTIONS])
def test_engine_options_refuse_naming_the_option(name, kw, error, match):
    with pytest.raises(error, match=match):
        EngineOptions(**kw)


def test_engine_options_accept_each_option_at_its_plain_values():
    assert EngineOptions(graphs=False).graphs is False  # no compile: nothing needs the graph path
    assert EngineOptions(graphs=False, compile=False).compile is False
    assert EngineOptions(compile=None).compile is None and EngineOptions(compile=True, graphs=True).compile is True
    assert EngineOptions(tp_timeout_s=0.5).tp_timeout_s == 0.5
    # Filters in any order and collection are one sampler: sorted into a tuple, equal options.
    a, b = EngineOptions(sampler=["top_p", "min_p"]), EngineOptions(sampler={"min_p", "top_p"})
    assert a.sampler == b.sampler == ("min_p", "top_p") and a == b
    assert EngineOptions(sampler=[]).sampler == ()


def test_an_engine_without_max_pages_or_on_a_training_model_is_refused():
    model = build("llama")
    with pytest.raises(ValueError, match=r"Engine: options\.max_pages is required"):
        Engine(model, "reference")  # the default options leave the cache's size to generate()
    model.train()
    with pytest.raises(ValueError, match=r"Engine: the model is in training mode \(dropout\); call model\.eval"):
        Engine(model, "reference", EngineOptions(max_pages=8))
    untouched(model)
