"""The counter-based hash behind every draw, against the same hash computed here on Python ints and
a few values written out: a request's key from its seed, one uniform strictly inside (0, 1) per
(key, position), and the token a row draws: the first whose cumulative probability reaches it."""

from __future__ import annotations

import math
import random

import torch

from mstar_core.sampling import Sampler, SamplingParams, request_key, uniforms

MASK = 2**32 - 1
MUL = 0x45D9F3B
STEP = 0x61C88647


def mix32(h: int) -> int:
    """Two xor-shift-multiply rounds and a last xor-shift of a 32-bit value."""
    for _ in range(2):
        h ^= h >> 16
        h = h * MUL & MASK
    return h ^ (h >> 16)


def unmix32(h: int) -> int:
    """The value :func:`mix32` takes to ``h`` (each step is invertible: an odd multiplier)."""
    inverse = pow(MUL, -1, 2**32)
    for _ in range(2):
        h ^= h >> 16
        h = h * inverse & MASK
    return h ^ (h >> 16)


def key_of(seed: int) -> int:
    return mix32((seed ^ seed >> 32) & MASK)


def uniform(key: int, position: int) -> float:
    """The middle of the hash's 23-bit bin."""
    return ((mix32((key + position * STEP) & MASK) >> 9) + 0.5) / 2**23


# (seed, position, the uniform's 23-bit bin), written out so a change to the hash shows here too.
GOLDEN = [(0, 0, 0), (1, 0, 741308), (1, 1, 7610057), (11, 7, 6696778), (2**63 - 1, 3, 6626489)]


def test_written_out_draws_stay_what_they_were():
    assert [request_key(s) for s in (0, 1, 11, 2**63 - 1)] == [0, 0x31251BA7, 0xA085B4C, 0x3D5A6175]
    keys = torch.tensor([request_key(s) for s, _, _ in GOLDEN])
    got = uniforms(keys, torch.tensor([p for _, p, _ in GOLDEN]))
    assert got.tolist() == [(b + 0.5) / 2**23 for _, _, b in GOLDEN]


def test_keys_and_uniforms_are_the_hash_on_python_ints():
    g = random.Random(0)
    seeds = [0, 1, 2**32, 2**63 - 1] + [g.getrandbits(63) for _ in range(300)]
    positions = [0, 1, 2**31, MASK] + [g.getrandbits(32) for _ in range(300)]
    keys = [request_key(s) for s in seeds]
    assert keys == [key_of(s) for s in seeds]
    got = uniforms(torch.tensor(keys), torch.tensor(positions)).tolist()
    assert got == [uniform(k, p) for k, p in zip(keys, positions, strict=True)]


def test_the_hashs_least_and_greatest_values_give_uniforms_inside_0_1():
    assert mix32(unmix32(MASK)) == MASK and mix32(0) == 0
    u = uniforms(torch.tensor([0, unmix32(MASK)]), torch.zeros(2, dtype=torch.long))
    assert u.tolist() == [2**-24, 1 - 2**-24]


def test_a_draw_is_the_first_token_whose_cumulative_probability_reaches_its_uniform():
    logits = torch.tensor([0.5, -0.3, 1.0, 0.2, 0.0, 0.6, -1.0, 0.4])
    probs = torch.softmax(logits.double(), -1).tolist()
    cum = [sum(probs[: i + 1]) for i in range(len(probs))]
    s = Sampler("cpu", 64, 8)
    s.set_rows([s.admit(SamplingParams(temperature=1.0), seed, []) for seed in range(64)])
    got = s.sample(logits.expand(64, 8).clone(), torch.arange(64) * 3 + 1).tolist()
    want = [next(i for i, c in enumerate(cum) if c >= uniform(key_of(seed), 3 * seed + 1)) for seed in range(64)]
    assert got == want and len(set(want)) == 8


def test_top_p_1_keeps_a_token_too_light_to_move_the_rows_sum():
    # Seed 0 at position 0 draws the least uniform, 2**-24: it lands on the second of two tokens
    # of weight 5e-8 beside one of weight 1 (the float32 sum of the three is 1 or 1 + 2**-23).
    assert uniform(key_of(0), 0) == 2**-24
    logits = torch.tensor([math.log(5e-8)] * 2 + [0.0] + [-math.inf] * 9)
    s = Sampler("cpu", 1, 12)
    s.set_rows([s.admit(SamplingParams(temperature=1.0), 0, [])])
    assert s.sample(logits[None], torch.tensor([0])).tolist() == [1]
