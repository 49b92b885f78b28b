"""The sampler's slots and rows: its sizes checked one by one, a slot per held request and never the
padding rows', a release that frees a held slot once and nothing else, a re-admitted slot that
forgets its last request's tokens, and rows past a step's own that draw as the padding slot."""

from __future__ import annotations

import pytest
import torch

from mstar_core.errors import InputError, StateError
from mstar_core.sampling import Sampler, SamplingParams

VOCAB = 12
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -1.5])
PENALTY = SamplingParams(repetition_penalty=3.0)  # greedy: token 0 unless it was seen


@pytest.mark.parametrize("max_rows, vocab", [(0, VOCAB), (-1, VOCAB), (2.0, VOCAB), (True, VOCAB),
                                             (2, 0), (2, -3), (2, 12.0), (2, True)])
def test_a_sampler_needs_int_sizes_of_at_least_1(max_rows, vocab):
    with pytest.raises(InputError, match="max_rows and vocab must be ints >= 1"):
        Sampler("cpu", max_rows, vocab)


def test_the_smallest_sampler_draws_its_one_token():
    s = Sampler("cpu", 1, 1)
    s.set_rows([s.admit(SamplingParams(temperature=1.0, top_k=1, top_p=0.5, min_p=0.5), 3, [0])])
    assert s.sample(torch.zeros(1, 1), torch.tensor([0])).tolist() == [0]


def test_the_seen_table_holds_a_row_per_slot_and_the_padding_rows_only_with_the_penalty():
    assert Sampler("cpu", 3, VOCAB).seen.shape == (4, VOCAB)
    assert Sampler("cpu", 3, VOCAB, ("top_k",)).seen.shape == (0, VOCAB)
    assert Sampler("cpu", 3, VOCAB).params.shape == (4, 5)


@pytest.mark.parametrize("vocab, chunk", [(32000, 256), (151936, 128), (96, 32), (50000, 256), (VOCAB, 256)])
def test_the_inverse_cdf_chunk_divides_the_vocabulary_where_one_can(vocab, chunk):
    assert Sampler("cpu", 1, vocab, ()).chunk == chunk


def test_each_held_request_has_its_own_slot_until_every_slot_is_held():
    s = Sampler("cpu", 3, VOCAB)
    assert sorted(s.admit(SamplingParams(), i, []) for i in range(3)) == [0, 1, 2]
    with pytest.raises(StateError, match="all 3 slots are held"):
        s.admit(SamplingParams(), 3, [])


def test_a_release_frees_a_held_slot_once_and_nothing_else():
    s = Sampler("cpu", 2, VOCAB)
    a, b = s.admit(SamplingParams(), 0, []), s.admit(SamplingParams(), 1, [])
    for slot in (s.pad, s.pad + 1, -1):  # the padding rows' slot, and none
        s.release(slot)
    with pytest.raises(StateError):
        s.admit(SamplingParams(), 2, [])
    s.release(a)
    s.release(a)
    assert s.admit(SamplingParams(), 3, []) == a
    with pytest.raises(StateError):
        s.admit(SamplingParams(), 4, [])
    assert b != a


def test_a_readmitted_slot_forgets_the_last_requests_tokens():
    s = Sampler("cpu", 1, VOCAB, ("repetition_penalty",))
    s.release(s.admit(PENALTY, 0, [0, 1]))
    s.set_rows([s.admit(PENALTY, 0, [5])])
    assert s.sample(LOGITS[None].clone(), torch.tensor([0])).tolist() == [0]


def test_prompt_ids_outside_the_vocabulary_are_not_counted_as_seen():
    s = Sampler("cpu", 1, VOCAB, ("repetition_penalty",))
    slot = s.admit(PENALTY, 0, [VOCAB, 3, -1, VOCAB + 7])
    assert s.seen[slot].nonzero()[:, 0].tolist() == [3]


def test_set_rows_refuses_more_rows_than_the_sampler_holds():
    s = Sampler("cpu", 2, VOCAB)
    slots = [s.admit(SamplingParams(), i, []) for i in range(2)]
    with pytest.raises(InputError, match="3 rows, the sampler holds 2"):
        s.set_rows([*slots, slots[0]])


@pytest.mark.parametrize("fewer", [1, 0])
def test_rows_past_the_steps_own_draw_as_the_padding_slot(fewer):
    """A captured step's rows past the ones set (its bucket's padding) take the spare slot's greedy
    argmax, not the parameters or the seen tokens of a request set there before."""
    s = Sampler("cpu", 2, VOCAB, ("repetition_penalty",))
    slots = [s.admit(PENALTY, i, [0]) for i in range(2)]
    s.set_rows(slots)
    s.set_rows(slots[:fewer])
    got = s.sample(LOGITS.expand(2, VOCAB).clone(), torch.arange(2)).tolist()
    assert got == [1, 0][:fewer] + [0] * (2 - fewer)
    assert s.seen[slots[fewer]].nonzero()[:, 0].tolist() == [0]  # its prompt's, no padding row's draw
