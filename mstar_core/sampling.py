"""Per-request sampling: the parameters (:class:`SamplingParams`) and the on-device sampler that
turns a step's logits into its next tokens (:class:`Sampler`) inside the step, captured graphs
included, with no host synchronisation.

A request's draws come from a counter-based hash of (its seed, the position of the token drawn),
never from a shared generator: the same seed gives the same tokens alone or in any batch wherever
the logits are the same (always, in float32 on CPU). Filters follow transformers' order:
repetition penalty on the raw logits, then temperature, top-k, top-p, min-p; one uniform per row
picks the token by inverse CDF over what the filters kept. Temperature 0 is greedy (argmax of the
penalised logits), exactly as without a sampler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar_core.errors import InputError, InputTypeError
from mstar_core.step import is_int

__all__ = ["FILTERS", "SamplingParams", "check_sampling"]

# The filters a sampler can apply; a sampler built without one refuses requests that need it
# (each costs work in every step: top-k and top-p sort the vocabulary).
FILTERS = ("repetition_penalty", "top_k", "top_p", "min_p")
SEED_BITS = 63


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputTypeError(f"SamplingParams: {name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are drawn. The defaults are greedy decoding.

    ``temperature`` 0 is greedy; ``top_k`` 0 keeps every token; ``top_p`` 1 and ``min_p`` 0 keep
    every token; ``repetition_penalty`` 1 changes nothing (> 1 discourages every token already in
    the prompt or the output, as transformers does). ``seed``: an int in 0..2**63-1 that fixes the
    request's draws; None draws one from torch's default generator when the request is made (so
    ``torch.manual_seed`` makes a run repeatable)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = _number(self.temperature, "temperature")
        if t < 0:
            raise InputError(f"SamplingParams: temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InputError(f"SamplingParams: top_k must be an int >= 0 (0: every token), got {self.top_k!r}")
        p = _number(self.top_p, "top_p")
        if not 0 < p <= 1:
            raise InputError(f"SamplingParams: top_p must be in (0, 1] (1: every token), got {self.top_p!r}")
        m = _number(self.min_p, "min_p")
        if not 0 <= m <= 1:
            raise InputError(f"SamplingParams: min_p must be in [0, 1] (0: every token), got {self.min_p!r}")
        r = _number(self.repetition_penalty, "repetition_penalty")
        if r <= 0:
            raise InputError(f"SamplingParams: repetition_penalty must be > 0 (1: none), got "
                             f"{self.repetition_penalty!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 1 << SEED_BITS):
            raise InputError(f"SamplingParams: seed must be None or an int in 0..2**{SEED_BITS}-1, got {self.seed!r}")
        for name, value in (("temperature", t), ("top_p", p), ("min_p", m), ("repetition_penalty", r)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def filters(self) -> set[str]:
        """The filters this request needs from the sampler (none for plain greedy)."""
        out = set()
        if self.repetition_penalty != 1.0:
            out.add("repetition_penalty")
        if not self.greedy:
            if self.top_k:
                out.add("top_k")
            if self.top_p < 1.0:
                out.add("top_p")
            if self.min_p > 0.0:
                out.add("min_p")
        return out


def check_sampling(sampling: object, count: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per request: None (greedy), one for every request, or a
    sequence of ``count``."""
    if sampling is None:
        return [SamplingParams()] * count
    if isinstance(sampling, SamplingParams):
        return [sampling] * count
    if isinstance(sampling, Sequence) and not isinstance(sampling, (str, bytes)) and len(sampling) == count \
            and all(isinstance(s, SamplingParams) for s in sampling):
        return list(sampling)
    raise InputTypeError(f"generate: sampling must be None, a SamplingParams or a list of one per prompt ({count}), "
                         f"got {sampling!r:.80}")


def request_seed(params: SamplingParams) -> int:
    """The request's seed: its own, or one drawn from torch's default generator."""
    if params.seed is not None:
        return params.seed
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
