"""SamplingParams and check_sampling: the fields normalised to one type each, the filters a request
needs from the sampler and whether it needs one at all, and a sampling argument taken only as None,
one params for every prompt or a sequence holding one per prompt."""

from __future__ import annotations

import pytest

from mstar_core.errors import InputError, InputTypeError
from mstar_core.sampling import SamplingParams, check_sampling


class _Count(int):
    """An integer of another type (as numpy's are): top_k keeps its value, as a plain int."""


def test_fields_are_normalised_to_float_and_int():
    p = SamplingParams(temperature=1, top_k=_Count(3), top_p=1, min_p=0, repetition_penalty=2)
    assert [type(v) for v in (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty)] \
        == [float, int, float, float, float]
    assert repr(p) == ("SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, repetition_penalty=2.0, "
                       "seed=None)")


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty"])
def test_a_bool_is_not_a_number(name):
    with pytest.raises(InputTypeError, match=f"{name} must be a finite number, got True"):
        SamplingParams(**{name: True})


@pytest.mark.parametrize("min_p", [0.0, 1.0])
def test_min_p_range_is_closed(min_p):
    assert SamplingParams(min_p=min_p).min_p == min_p


@pytest.mark.parametrize("min_p", [1.0000001, 2.0])
def test_min_p_past_one_is_refused(min_p):
    with pytest.raises(InputError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=min_p)


@pytest.mark.parametrize("kw, needs_sampler, filters", [
    (dict(), False, set()),
    (dict(top_k=5, top_p=0.5, min_p=0.5), False, set()),  # filters mean nothing to greedy decoding
    (dict(repetition_penalty=2.0), True, {"repetition_penalty"}),
    (dict(repetition_penalty=0.5), True, {"repetition_penalty"}),
    (dict(temperature=1.0), True, set()),
    (dict(temperature=0.5, top_k=1), True, {"top_k"}),
    (dict(temperature=0.5, top_p=0.999), True, {"top_p"}),
    (dict(temperature=0.5, min_p=0.5), True, {"min_p"}),
    (dict(temperature=0.5, min_p=1.0), True, {"min_p"}),
    (dict(temperature=2.0, top_k=3, top_p=0.9, min_p=0.01, repetition_penalty=1.1), True,
     {"top_k", "top_p", "min_p", "repetition_penalty"}),
])
def test_a_request_needs_the_filters_it_sets(kw, needs_sampler, filters):
    p = SamplingParams(**kw)
    assert p.needs_sampler is needs_sampler
    assert p.filters() == filters


def test_check_sampling_takes_a_sequence_of_one_per_prompt():
    a, b = SamplingParams(temperature=1.0), SamplingParams(top_k=2)
    assert check_sampling((a, b), 2) == [a, b]
    assert check_sampling([], 0) == []


@pytest.mark.parametrize("sampling, count", [
    ({SamplingParams()}, 1),  # a set has no order to match the prompts'
    ({SamplingParams(): 0}, 1),
    ([SamplingParams(), "greedy"], 2),
    (["greedy", SamplingParams()], 2),
    ("", 0),  # a string is never a list of params, even an empty one
    (b"", 0),
    ([SamplingParams()] * 3, 2),
])
def test_check_sampling_refuses_anything_else(sampling, count):
    with pytest.raises(InputTypeError, match=f"one per prompt \\({count}\\)"):
        check_sampling(sampling, count)
