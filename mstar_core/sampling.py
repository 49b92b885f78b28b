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
from typing import TypeVar

import torch

from mstar_core.errors import InputError, InputTypeError, StateError
from mstar_core.step import is_int

__all__ = ["FILTERS", "Sampler", "SamplingParams", "check_sampling"]

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

    @property
    def needs_sampler(self) -> bool:
        """Whether the step must do more than an argmax for this request."""
        return not self.greedy or self.repetition_penalty != 1.0

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


_MASK32 = 0xFFFFFFFF
# Odd and < 2**31: a 32-bit value times either stays inside int64 (no signed overflow).
_MUL = 0x45D9F3B
_STEP = 0x61C88647  # 2**32 / golden ratio, less 2**31: positions spread over the key space

_T = TypeVar("_T", int, torch.Tensor)


def _mix32(h: _T) -> _T:
    """A 32-bit integer hash of values in 0..2**32-1 (xor-shift-multiply rounds; on int64
    tensors and on Python ints alike)."""
    h = h ^ (h >> 16)
    h = (h * _MUL) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _MUL) & _MASK32
    return h ^ (h >> 16)


def request_key(seed: int) -> int:
    """A 63-bit seed as the 32-bit key the per-step hash takes (hashed once, on the host)."""
    return _mix32((seed ^ (seed >> 32)) & _MASK32)


def uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One float32 in (0, 1) per row from its key (:func:`request_key`) and the position it
    draws at: the same pair gives the same value on every device and in any batch."""
    h = _mix32((keys + (positions.long() & _MASK32) * _STEP) & _MASK32)
    # 23 bits: each value the middle of its bin, held exactly in float32 (k + 0.5 over 2**24 is
    # not: its top bin rounds to 1).
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def _host_to(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device: on CUDA through pinned
    memory (the caching host allocator keeps it until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Sampler:
    """Next tokens from a step's logits, on the device, for up to ``max_rows`` requests at once.

    Each request holds a slot of per-request tables (its parameters, its key, and with the
    repetition penalty the tokens it has seen) from :meth:`admit` to :meth:`release`; before a
    step, :meth:`set_rows` says which slot each row is (a static buffer a captured graph reads;
    rows past the step's are padding and use the spare slot). ``filters``: the subset of
    :data:`FILTERS` this sampler applies (temperature is always there)."""

    def __init__(self, device: torch.device | str, max_rows: int, vocab: int,
                 filters: Sequence[str] = FILTERS) -> None:
        unknown = sorted(set(filters) - set(FILTERS))
        if unknown:
            raise InputError(f"Sampler: unknown filters {unknown}; the filters are {list(FILTERS)}")
        if not is_int(max_rows) or max_rows < 1 or not is_int(vocab) or vocab < 1:
            raise InputError(f"Sampler: max_rows and vocab must be ints >= 1, got {max_rows!r}, {vocab!r}")
        self.device = torch.device(device)
        self.filters = frozenset(filters)
        self.vocab = vocab
        slots = max_rows + 1  # the last is the padding rows'
        self.pad = max_rows
        dev = self.device
        # Per slot, one row of each table, so a step gathers its rows' parameters in two reads:
        # (sampled 1/0, 1/temperature, top_p, min_p, penalty) and (top_k, key).
        self.params = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]] * slots, device=dev)
        self.ints = torch.zeros(slots, 2, dtype=torch.long, device=dev)
        penalize = "repetition_penalty" in self.filters
        self.seen = torch.zeros(slots if penalize else 0, vocab, dtype=torch.bool, device=dev)
        self.rows = torch.full((max_rows,), self.pad, dtype=torch.long, device=dev)
        self._true = torch.ones((), dtype=torch.bool, device=dev)
        # The inverse CDF's chunk: a divisor of the vocabulary near its square root where one is
        # (no padding), else 256.
        self.chunk = next((c for c in (256, 128, 512, 64, 1024, 32) if vocab % c == 0), 256)
        self._rows_key: tuple[int, ...] = ()
        self._free = list(range(max_rows - 1, -1, -1))

    def admit(self, params: SamplingParams, seed: int, context: Sequence[int]) -> int:
        """A slot for a request drawing with ``params`` and ``seed``; ``context`` (its prompt) is
        what the repetition penalty counts as seen. Refused, naming the option, when this sampler
        lacks a filter the request needs."""
        missing = self.missing(params)
        if missing:
            raise InputError(f"the engine's sampler was built without {missing} (filters {sorted(self.filters)}); "
                             f"build it with EngineOptions(sampler=...) including them")
        if not self._free:
            raise StateError(f"Sampler: all {self.pad} slots are held (release finished requests first)")
        slot = self._free.pop()
        t = params.temperature
        values = [float(t > 0), 1.0 / t if t > 0 else 1.0, params.top_p, params.min_p, params.repetition_penalty]
        self.params[slot].copy_(_host_to(values, torch.float32, self.device), non_blocking=True)
        self.ints[slot].copy_(_host_to([params.top_k, request_key(seed)], torch.long, self.device), non_blocking=True)
        if self.seen.numel():
            self.seen[slot] = False
            ids = [t for t in context if 0 <= t < self.vocab]
            if ids:
                self.seen[slot, _host_to(ids, torch.long, self.device)] = True
        return slot

    def missing(self, params: SamplingParams) -> list[str]:
        """The filters ``params`` needs that this sampler does not apply."""
        return sorted(params.filters() - self.filters)

    def release(self, slot: int) -> None:
        if slot not in self._free and 0 <= slot < self.pad:
            self._free.append(slot)

    def set_rows(self, slots: Sequence[int]) -> None:
        """The slot of each row of the next step (in stream order: a step in flight keeps the
        rows it was launched with)."""
        key = tuple(slots)
        if key == self._rows_key:
            return
        n = len(key)
        if n > self.rows.numel():
            raise InputError(f"Sampler.set_rows: {n} rows, the sampler holds {self.rows.numel()}")
        self.rows[:n].copy_(_host_to(list(key), torch.long, self.device), non_blocking=True)
        self.rows[n:].fill_(self.pad)
        self._rows_key = key

    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The next token of each row of ``logits [rows, vocab]``; ``positions[rows]``: the
        position of each row's last input token (what makes each draw of a request distinct)."""
        n = logits.shape[0]
        rows = self.rows[:n]
        f, ints = self.params[rows], self.ints[rows]
        x = logits
        if "repetition_penalty" in self.filters:
            x = x.float()
            p = f[:, 4:5]
            x = torch.where(self.seen[rows], torch.where(x > 0, x / p, x * p), x)
        top, greedy = x.max(-1)
        inv_t = f[:, 1:2]
        # Each token's weight exp((x - max) / T): the softmax unnormalised (the most likely is 1).
        shift = -(top[:, None] * inv_t)
        w = torch.addcmul(shift, x, inv_t).exp_()
        if self.filters & {"top_k", "top_p"}:
            # The weights are monotone in the logits: sorting the logits (bf16 keys on a GPU, half
            # a float32 sort's passes) and weighing them sorted gives the sorted weights, bit for bit.
            ws = torch.addcmul(shift, x.sort(-1, descending=True).values, inv_t).exp_()
            w = torch.where(w >= self._ranked_floor(ws, ints[:, 0:1], f[:, 2]), w, 0.0)
        if "min_p" in self.filters:  # after top-p, as transformers orders them (the most likely stays)
            # Scaled by the most likely token's weight: rounding may leave it just under 1.
            w = torch.where(w >= f[:, 3:4] * w.gather(-1, greedy[:, None]), w, 0.0)
        # Drawn in vocabulary order whatever the filters, so a request's draw never depends on
        # which filters its batch-mates needed.
        picked = self._reaching(w, uniforms(ints[:, 1], positions))
        tokens = torch.where(f[:, 0] > 0, picked, greedy)
        if "repetition_penalty" in self.filters:
            # A device value: a Python True would be copied from the host, which a capture refuses.
            self.seen.index_put_((rows, tokens), self._true)
        return tokens

    def _ranked_floor(self, ws: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """The least weight top-k and top-p keep, per row ``[rows, 1]`` (ties with it stay, as
        transformers keeps them), from the weights sorted in descending order."""
        v = ws.shape[-1]
        floor = ws[:, -1:]
        if "top_k" in self.filters:
            floor = torch.where(k > 0, ws.gather(-1, (k - 1).clamp(0, v - 1)), floor)
            ws = torch.where(ws >= floor, ws, 0.0)  # top-p then counts what top-k kept
        if "top_p" in self.filters:
            # The last token of the smallest prefix holding top_p of the mass; 1 keeps every token.
            last = self._reaching(ws, top_p)
            floor = torch.where((top_p < 1)[:, None], ws.gather(-1, last[:, None]), floor)
        return floor

    def _reaching(self, w: torch.Tensor, fraction: torch.Tensor) -> torch.Tensor:
        """Per row, the first index whose cumulative weight reaches ``fraction`` of the row's
        (> 0 for some index; never an index of weight 0): an inverse CDF in two levels, over
        chunks of ``self.chunk`` and within the chunk found, so no scan spans the vocabulary."""
        n, v = w.shape
        b = self.chunk
        if v % b:
            w = torch.nn.functional.pad(w, (0, b - v % b))
        chunks = w.view(n, -1, b)
        cum = chunks.sum(-1).cumsum(-1)  # [rows, chunks]
        target = fraction[:, None] * cum[:, -1:]
        j = torch.searchsorted(cum, target.contiguous()).clamp_max(cum.shape[-1] - 1)  # [rows, 1]
        before = torch.where(j > 0, cum.gather(-1, (j - 1).clamp_min(0)), 0.0)
        inner = chunks.gather(1, j[:, :, None].expand(n, 1, b))[:, 0].cumsum(-1)  # [rows, chunk]
        # Rounding may leave the remainder at or past the chunk's total, or at 0: clamp it inside.
        rest = (target - before).clamp(min=torch.finfo(w.dtype).tiny).minimum(inner[:, -1:])
        i = torch.searchsorted(inner, rest.contiguous())[:, 0].clamp_max(b - 1)
        return (j[:, 0] * b + i).clamp_max(v - 1)
