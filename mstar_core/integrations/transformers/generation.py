"""What a generation run returns: the new token ids, each step's record, and their text report."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepRecord:
    kind: str  # prefill, mixed or decode
    rows: int
    tokens: int
    graph: bool
    read_s: float  # when its token ids reached the host, from the start of the run


@dataclass(frozen=True)
class Generation:
    """What a run produced: ``ids[i]`` the new tokens of prompt ``i`` (ending at its first
    end-of-sequence token, which is kept), and how it ran."""

    ids: list[list[int]]
    backend: str
    steps: tuple[StepRecord, ...]
    waits: int  # admissions deferred (pages or the step's prompt budget)
    seconds: float
    first_token_s: tuple[float, ...]  # per prompt: from joining to its first token on the host
    device: str  # where it ran: says how graph steps ran
    compiled: str | None = None  # what torch.compile compiled at warm-up, and how long it took (None: nothing)
    # per prompt: its tokens found in the prefix cache (None: the cache was off)
    cached_tokens: tuple[int, ...] | None = None
    prompt_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache, of all prompt tokens (None: the cache was off)."""
        if self.cached_tokens is None:
            return None
        return sum(self.cached_tokens) / max(self.prompt_tokens, 1)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the model computed (those not found in the prefix cache)."""
        return self.prompt_tokens - sum(self.cached_tokens or ())

    @property
    def kinds(self) -> dict[str, int]:
        out = {"prefill": 0, "mixed": 0, "decode": 0}
        for s in self.steps:
            out[s.kind] += 1
        return out

    @property
    def new_tokens(self) -> int:
        return sum(len(x) for x in self.ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    def decode_step_ms(self) -> list[float]:
        """Intervals between the host reads of consecutive decode steps of equal rows: a decode
        step's wall time in the steady state (nothing joined or left between them)."""
        s = self.steps
        return [(b.read_s - a.read_s) * 1e3 for a, b in itertools.pairwise(s)
                if a.kind == b.kind == "decode" and a.rows == b.rows]

    def lines(self) -> list[str]:
        """The report; graph steps are said to be replayed from CUDA graphs on CUDA, and off CUDA
        to run through the graph path, each replay re-running the forward."""
        kinds = ", ".join(f"{k} {v}" for k, v in self.kinds.items())
        graph = sum(1 for x in self.steps if x.graph)
        dev = torch.device(self.device)
        how = ("replayed from CUDA graphs" if dev.type == "cuda" else
               f"through the graph path on {dev.type} (no CUDA graphs: each replay re-runs the forward)")
        ttft = sorted(self.first_token_s)
        dec = sorted(self.decode_step_ms())
        lines = [
            f"backend: {self.backend}",
            f"steps: {len(self.steps)} ({kinds}; {graph} {how}); admissions deferred: {self.waits}",
            f"new tokens: {self.new_tokens} in {self.seconds:.2f} s ({self.tokens_per_s:.0f} tokens/s)",
            f"time to first token: median {ttft[len(ttft) // 2] * 1e3:.1f} ms, max {ttft[-1] * 1e3:.1f} ms",
        ]
        if dec:
            lines.append(f"decode step: median {dec[len(dec) // 2]:.3f} ms over {len(dec)} steady steps")
        if self.cached_tokens is not None:
            lines.append(f"prefix cache: {sum(self.cached_tokens)} of {self.prompt_tokens} prompt tokens found "
                         f"({self.prefix_hit_rate:.1%}); {self.prefill_tokens} computed")
        if self.compiled:
            lines.append(f"graph steps {self.compiled} (at warm-up)")
        return lines
