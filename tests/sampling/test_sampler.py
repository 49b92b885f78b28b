"""The on-device sampler against transformers' own logits processors: the distribution it draws
from (a chi-squared test on many seeded draws), the tokens each filter may give, greedy rows,
and draws fixed by a request's seed whatever the batch, moved by every bit of it."""

from __future__ import annotations

import math

import pytest
import torch

from mstar_core.errors import InputError, InputTypeError
from mstar_core.sampling import FILTERS, Sampler, SamplingParams, check_sampling, request_seed, uniforms

VOCAB = 12
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -1.5])
DRAWS = 6000


def critical(df: int, z: float = 3.29) -> float:
    """The chi-squared value a fair sample exceeds with probability ~5e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """The statistic over the tokens ``probs`` may give (and inf if another one was drawn)."""
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return math.inf, 1
    n = counts.sum().item()
    exp = probs[keep] * n
    return (((counts[keep] - exp) ** 2) / exp).sum().item(), int(keep.sum()) - 1


def draw(params: SamplingParams, rows: int = DRAWS, seen: list[int] = (), logits: torch.Tensor = LOGITS):
    """One draw for each of ``rows`` requests with seeds 0..rows-1 and the same logits."""
    s = Sampler("cpu", rows, VOCAB)
    slots = [s.admit(SamplingParams(**{**params.__dict__, "seed": i}), i, list(seen)) for i in range(rows)]
    s.set_rows(slots)
    return s.sample(logits.expand(rows, VOCAB).clone(), torch.full((rows,), 7))


def transformers_probs(params: SamplingParams, seen: list[int] = ()) -> torch.Tensor:
    """What transformers' own processors leave, in its order, as probabilities."""
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([list(seen) or [0]])
    x = LOGITS[None].clone()
    if seen and params.repetition_penalty != 1:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(params.temperature)(ids, x)
    if params.top_k:
        x = TopKLogitsWarper(params.top_k)(ids, x)
    if params.top_p < 1:
        x = TopPLogitsWarper(params.top_p)(ids, x)
    if params.min_p > 0:
        x = MinPLogitsWarper(params.min_p)(ids, x)
    return torch.softmax(x, -1)[0].double()


CASES = {
    "temperature-1": SamplingParams(temperature=1.0),
    "temperature-0.6": SamplingParams(temperature=0.6),
    "top-k-4": SamplingParams(temperature=1.0, top_k=4),
    "top-p-0.7": SamplingParams(temperature=0.8, top_p=0.7),
    "min-p-0.2": SamplingParams(temperature=1.2, min_p=0.2),
    "all-filters": SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
    "penalty": SamplingParams(temperature=1.0, repetition_penalty=1.8),
    # Top-p over what top-k kept, the k-th token included: both of the two stay.
    "top-k-then-top-p": SamplingParams(temperature=1.0, top_k=2, top_p=0.9),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.requires_transformers
def test_draws_follow_transformers_distribution(name):
    params = CASES[name]
    seen = [0, 1, 9] if params.repetition_penalty != 1 else []
    counts = torch.bincount(draw(params, seen=seen), minlength=VOCAB).double()
    want = transformers_probs(params, seen)
    stat, df = chi2(counts, want)
    assert stat < critical(df), (name, counts.tolist(), (want * DRAWS).tolist())


@pytest.mark.requires_transformers
def test_the_chi_squared_check_tells_one_temperature_from_another():
    counts = torch.bincount(draw(CASES["temperature-1"]), minlength=VOCAB).double()
    stat, df = chi2(counts, transformers_probs(CASES["temperature-0.6"]))
    assert stat > 10 * critical(df)


@pytest.mark.requires_transformers
def test_filters_never_give_a_token_they_removed():
    assert set(draw(SamplingParams(temperature=5.0, top_k=3)).tolist()) == {0, 1, 2}
    kept = transformers_probs(SamplingParams(temperature=1.0, top_p=0.5)) > 0
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.5)).tolist()) == set(kept.nonzero()[:, 0].tolist())
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.5)).tolist()) <= {0, 1, 2}


def test_a_row_masked_by_the_model_draws_only_what_it_allows():
    logits = LOGITS.clone()
    logits[1::2] = -math.inf
    got = draw(SamplingParams(temperature=1.0, top_p=0.95), rows=500, logits=logits)
    assert set(got.tolist()) <= set(range(0, VOCAB, 2))


def test_greedy_rows_are_the_argmax_beside_sampled_ones():
    s = Sampler("cpu", 4, VOCAB)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    slots = [s.admit(SamplingParams(temperature=t, top_k=2), 5, []) for t in (0.0, 3.0, 0.0, 3.0)]
    s.set_rows(slots)
    out = s.sample(logits, torch.arange(4))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


@pytest.mark.requires_transformers
def test_greedy_with_a_repetition_penalty_is_transformers_penalised_argmax():
    from transformers import RepetitionPenaltyLogitsProcessor

    s = Sampler("cpu", 1, VOCAB, ("repetition_penalty",))
    s.set_rows([s.admit(SamplingParams(repetition_penalty=3.0), 0, [0, 1])])
    want = RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([[0, 1]]), LOGITS[None].clone()).argmax()
    assert s.sample(LOGITS[None].clone(), torch.tensor([4])).item() == want.item() == 2
    # The drawn token counts as seen from then on.
    assert s.seen[0, 2]


def test_a_seed_fixes_the_draw_alone_or_in_any_batch_and_row():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=11)
    alone = Sampler("cpu", 1, VOCAB)
    alone.set_rows([alone.admit(params, 11, [])])
    want = alone.sample(logits[2:3], torch.tensor([9])).item()
    batch = Sampler("cpu", 8, VOCAB)
    others = [batch.admit(SamplingParams(temperature=1.0, seed=i), i, []) for i in range(5)]
    mine = batch.admit(params, 11, [])
    batch.set_rows([others[0], others[1], mine, *others[2:]])
    assert batch.sample(logits, torch.tensor([3, 4, 9, 5, 6, 7])).tolist()[2] == want
    # Other positions draw otherwise: a request's draws differ step to step.
    u = uniforms(torch.tensor([11] * 64), torch.arange(64))
    assert len(set(u.tolist())) == 64 and 0 < u.min() and u.max() < 1


@pytest.mark.parametrize("bit", [0, 31, 32, 47, 62])
def test_every_bit_of_a_seed_moves_the_draws(bit):
    """Seeds one bit apart (the high 32 too) draw otherwise, over 32 positions of flat logits."""
    seed = 0x2545F4914F6CDD1D & ~(1 << bit)
    s = Sampler("cpu", 64, VOCAB)
    a, b = (s.admit(SamplingParams(temperature=1.0), x, []) for x in (seed, seed | 1 << bit))
    s.set_rows([a] * 32 + [b] * 32)
    got = s.sample(torch.zeros(64, VOCAB), torch.arange(32).repeat(2)).tolist()
    assert got[:32] != got[32:]
    assert request_seed(SamplingParams(seed=seed | 1 << bit)) == seed | 1 << bit


def test_a_sampler_refuses_requests_needing_a_filter_it_lacks():
    s = Sampler("cpu", 2, VOCAB, ())
    with pytest.raises(InputError, match=r"built without \['top_p'\].*EngineOptions\(sampler=\.\.\.\)"):
        s.admit(SamplingParams(temperature=1.0, top_p=0.5), 0, [])
    with pytest.raises(InputError, match="unknown filters"):
        Sampler("cpu", 2, VOCAB, ("top_q",))
    assert set(FILTERS) == {"repetition_penalty", "top_k", "top_p", "min_p"}


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="1"), "temperature must be a finite number"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(top_k=2.0), "top_k must be an int >= 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(seed=-1), "seed must be None or an int"),
    (dict(seed=1 << 63), "seed must be None or an int"),
    (dict(seed=True), "seed must be None or an int"),
])
def test_bad_sampling_params_are_refused_naming_the_range(kw, match):
    with pytest.raises((InputError, InputTypeError), match=match):
        SamplingParams(**kw)


def test_sampling_is_one_params_for_all_or_one_per_prompt():
    p = SamplingParams(temperature=1.0)
    assert check_sampling(None, 2) == [SamplingParams()] * 2
    assert check_sampling(p, 3) == [p] * 3
    with pytest.raises(InputTypeError, match=r"one per prompt \(2\)"):
        check_sampling([p], 2)
    with pytest.raises(InputTypeError, match="SamplingParams"):
        check_sampling({"temperature": 1.0}, 1)


def test_a_vocabulary_of_several_chunks_draws_its_softmax():
    vocab = 768  # three chunks of 256: the two-level search crosses chunk edges
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 2
    s = Sampler("cpu", 4000, vocab)
    assert s.chunk == 256
    s.set_rows([s.admit(SamplingParams(temperature=1.0), i, []) for i in range(4000)])
    got = s.sample(logits.expand(4000, vocab).clone(), torch.full((4000,), 3))
    probs = torch.softmax(logits.double(), -1)
    counts = torch.bincount(got, minlength=vocab).double()
    rare = probs * 4000 < 5
    stat, df = chi2(torch.cat([counts[~rare], counts[rare].sum()[None]]),
                    torch.cat([probs[~rare], probs[rare].sum()[None]]))
    assert stat < critical(df)


def test_top_k_1_draws_the_argmax_and_a_top_k_past_the_vocabulary_keeps_every_token():
    assert set(draw(SamplingParams(temperature=5.0, top_k=1), rows=200).tolist()) == {0}
    every = draw(SamplingParams(temperature=2.0), rows=600)
    assert set(every.tolist()) == set(range(VOCAB))
    for k in (VOCAB, 50):
        assert torch.equal(draw(SamplingParams(temperature=2.0, top_k=k), rows=600), every), k


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.9])
def test_min_p_1_keeps_only_the_most_likely_tokens_at_any_temperature(temperature):
    logits = LOGITS.clone()
    logits[[3, 7]] = 2.5  # two most likely, tied
    got = draw(SamplingParams(temperature=temperature, min_p=1.0), rows=200, logits=logits)
    assert set(got.tolist()) == {3, 7}


@pytest.mark.requires_transformers
def test_the_repetition_penalty_divides_a_positive_logit_and_multiplies_a_negative_one():
    from transformers import RepetitionPenaltyLogitsProcessor

    # Token 0 is seen in every row; penalised the other way (or not at all), it stays the argmax.
    logits = torch.full((4, VOCAB), -5.0)
    logits[:, :2] = torch.tensor([[0.9, 0.5], [-0.2, -0.3], [3.0, 1.6], [0.0, -0.1]])
    s = Sampler("cpu", 4, VOCAB, ("repetition_penalty",))
    s.set_rows([s.admit(SamplingParams(repetition_penalty=2.0), 0, [0]) for _ in range(4)])
    want = RepetitionPenaltyLogitsProcessor(2.0)(torch.zeros(4, 1, dtype=torch.long), logits.clone()).argmax(-1)
    assert s.sample(logits, torch.arange(4)).tolist() == want.tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_logits_shifted_by_a_constant_draw_the_same_tokens(temperature):
    # The weights are taken relative to the most likely token's: large logits neither overflow nor vanish.
    params = SamplingParams(temperature=temperature, min_p=0.01)
    assert torch.equal(draw(params, rows=600, logits=LOGITS + 100), draw(params, rows=600))


def test_a_single_row_draws_from_any_chunk_of_a_large_vocabulary():
    vocab = 1000  # four chunks of 256, the last padded
    s = Sampler("cpu", 1, vocab)
    s.set_rows([s.admit(SamplingParams(temperature=1.0, top_k=3, top_p=0.9), 0, [])])
    for token in (5, 300, 700, 999):
        logits = torch.full((1, vocab), -20.0)
        logits[0, token] = 0.0
        assert s.sample(logits, torch.tensor([0])).item() == token


@pytest.mark.parametrize("filters", [(), FILTERS])
@pytest.mark.parametrize("vocab", [VOCAB, 700])
def test_a_row_of_nan_logits_still_draws_a_token_of_the_vocabulary(filters, vocab):
    """A padding row may hold anything; an index past the vocabulary would fault on a GPU."""
    s = Sampler("cpu", 2, vocab, filters)
    s.set_rows([s.admit(SamplingParams(temperature=1.0), i, []) for i in range(2)])
    logits = torch.zeros(2, vocab)
    logits[0] = math.nan
    logits[1, vocab // 2] = math.nan
    got = s.sample(logits, torch.tensor([3, 4]))
    assert ((0 <= got) & (got < vocab)).all(), got
