"""Sampled generation through mstar on a tiny model: seeded tokens the same alone, in a batch,
staggered, through the graph path and compiled, and other for seeds apart in their high bits; the
first token's distribution against the model's own softmax; the repetition penalty against
transformers' greedy generate; stops; and the time to first token and step times measured as
their names say."""

from __future__ import annotations

import functools
import itertools
import time

import pytest
import torch

from mstar_core import Engine, EngineOptions, generate
from mstar_core.errors import InputError
from mstar_core.integrations.transformers import generate_report, run
from mstar_core.sampling import SamplingParams
from mstar_core.testing.hf_models import build

from ...helpers import hf_greedy
from ...sampling.test_sampler import chi2, critical


@functools.cache
def model_and_prompts():
    model = build("llama")
    g = torch.Generator().manual_seed(5)
    return model, [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (4, 11, 1, 7)]


PARAMS = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=2),
          SamplingParams(), SamplingParams(temperature=1.5, min_p=0.05, repetition_penalty=1.3, seed=4)]


def test_seeded_tokens_are_the_same_alone_batched_staggered_and_through_the_graph_path():
    model, prompts = model_and_prompts()
    alone = [generate(model, [p], 12, "reference", sampling=s)[0] for p, s in zip(prompts, PARAMS, strict=True)]
    assert alone[2] == hf_greedy(model, prompts[2], 12)  # temperature 0 is greedy
    assert alone[0] != hf_greedy(model, prompts[0], 12)  # and the others did sample
    assert generate(model, prompts, 12, "reference", sampling=PARAMS) == alone
    assert generate(model, prompts, 12, "reference", sampling=PARAMS, arrivals=[3, 0, 5, 1], max_batch_size=2) == alone
    assert generate(model, prompts, 12, "reference", sampling=PARAMS, graphs=True, buckets=(2, 4)) == alone


def test_one_params_for_every_prompt_and_an_unseeded_run_repeatable_from_torch_seed():
    model, prompts = model_and_prompts()
    params = SamplingParams(temperature=1.0)
    torch.manual_seed(7)
    first = generate(model, prompts, 8, "reference", sampling=params)
    torch.manual_seed(7)
    assert generate(model, prompts, 8, "reference", sampling=params) == first
    torch.manual_seed(8)
    assert generate(model, prompts, 8, "reference", sampling=params) != first


def test_seeds_apart_only_in_their_high_bits_draw_other_tokens():
    model, prompts = model_and_prompts()
    seeds = [5, 5 + (1 << 32), 5 + (1 << 62)]
    got = generate(model, [prompts[0]] * 3, 12, "reference", eos_token_id=None,
                   sampling=[SamplingParams(temperature=1.0, seed=s) for s in seeds])
    assert len({tuple(g) for g in got}) == 3


def test_the_first_token_follows_the_models_softmax_at_temperature_1():
    model, prompts = model_and_prompts()
    n = 2000
    got = generate(model, [prompts[0]] * n, 1, "reference", eos_token_id=None,
                   sampling=[SamplingParams(temperature=1.0, seed=i) for i in range(n)])
    counts = torch.bincount(torch.tensor([g[0] for g in got]), minlength=model.config.vocab_size).double()
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1].double()
    probs = torch.softmax(logits, -1)
    # Tokens expected fewer than 5 times are pooled into one bin, as the test needs.
    rare = probs * n < 5
    c = torch.cat([counts[~rare], counts[rare].sum()[None]])
    p = torch.cat([probs[~rare], probs[rare].sum()[None]])
    stat, df = chi2(c, p)
    assert stat < critical(df), stat
    # The same counts are far from the distribution at another temperature.
    hot = torch.softmax(logits / 0.5, -1)
    stat_hot, df_hot = chi2(torch.cat([counts[~rare], counts[rare].sum()[None]]),
                            torch.cat([hot[~rare], hot[rare].sum()[None]]))
    assert stat_hot > 5 * critical(df_hot)


def test_greedy_with_a_repetition_penalty_equals_transformers_generate():
    model, prompts = model_and_prompts()
    params = SamplingParams(repetition_penalty=1.6)
    got = generate(model, prompts, 10, "reference", sampling=params)
    assert got == [hf_greedy(model, p, 10, repetition_penalty=1.6) for p in prompts]
    assert got != [hf_greedy(model, p, 10) for p in prompts]


def test_compiled_graph_steps_draw_the_same_tokens():
    model, prompts = model_and_prompts()
    want = generate(model, prompts, 8, "reference", sampling=PARAMS)
    assert generate(model, prompts, 8, "reference", sampling=PARAMS, compile=True, compile_backend="aot_eager",
                    buckets=(4,)) == want


def test_a_stop_ends_its_request_at_the_token_and_keeps_it():
    model, prompts = model_and_prompts()
    seen = []

    def stop(i, ids):
        seen.append((i, len(ids)))
        return i == 1 and len(ids) == 3

    got = generate(model, prompts, 9, "reference", stop=stop, eos_token_id=None)
    full = generate(model, prompts, 9, "reference", eos_token_id=None)
    assert got[1] == full[1][:3] and [len(g) for g in got] == [9, 3, 9, 9]
    assert (1, 4) not in seen and (0, 9) in seen


def test_sampling_needs_an_engine_with_a_sampler_holding_its_filters():
    model, prompts = model_and_prompts()
    with Engine(model, "reference", EngineOptions(max_pages=16)) as e:
        with pytest.raises(InputError, match=r"prompts \[0\] sample .*EngineOptions\(sampler="):
            run(e, prompts[:1], 2, sampling=SamplingParams(temperature=1.0))
    with Engine(model, "reference", EngineOptions(max_pages=16, sampler=())) as e:
        assert run(e, prompts[:1], 2, sampling=SamplingParams(temperature=1.0, seed=0)).ids
        with pytest.raises(InputError, match=r"prompt 0 needs the sampler's filters \['top_k'\]"):
            run(e, prompts[:1], 2, sampling=SamplingParams(temperature=1.0, top_k=3))
    with pytest.raises(InputError, match="sampler must be None"):
        EngineOptions(sampler=("top_q",))


STEP_S = 0.05


def _slow_forward(monkeypatch):
    """Every forward takes at least STEP_S: a run whose step times are known."""
    forward = Engine._forward

    def slow(self, ctx, tokens):
        time.sleep(STEP_S)
        return forward(self, ctx, tokens)

    monkeypatch.setattr(Engine, "_forward", slow)


@pytest.mark.parametrize("graphs", [False, True])
def test_time_to_first_token_and_step_times_are_what_their_names_say(monkeypatch, graphs):
    _slow_forward(monkeypatch)
    model, prompts = model_and_prompts()
    one = generate_report(model, prompts[:1], 1, "reference", graphs=graphs, buckets=(1,))
    assert STEP_S <= one.first_token_s[0] <= one.seconds < 2 * STEP_S  # one step: its own time, not two
    rep = generate_report(model, prompts[:1], 5, "reference", eos_token_id=None, graphs=graphs, buckets=(1,))
    dec = rep.decode_step_ms()
    assert len(dec) == 3  # four decode steps of one row
    assert all(STEP_S * 1e3 <= d < 2 * STEP_S * 1e3 for d in dec), dec
    assert STEP_S <= rep.first_token_s[0] < 2 * STEP_S
    done = [s.read_s for s in rep.steps]
    assert all(b - a >= STEP_S for a, b in itertools.pairwise(done)) and done[-1] <= rep.seconds
