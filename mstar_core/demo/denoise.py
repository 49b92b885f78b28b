"""The denoise example: a text-conditioning prefix committed once per request, then
denoise steps that recompute every fresh token with ``commit=False``, non-causal, on the dense
path. Every layer of every step is checked against full attention over [prefix | fresh] in
float64. In the middle, a fork (a new request whose stream copies a prefix's pages) and a reset
(a request's conditioning replaced) show the gathered-prefix cache being invalidated and
rebuilt; the gathers each step must cause are derived from the streams' generations and prefix
lengths and compared with the manager's counters.

The "model" is attention alone: each layer's q/k/v are random, drawn per (step, layer), which
is what a denoise step looks like to the attention resource.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar_core.attention.dense import DENSE_CAPABILITY, DenseAttentionManager
from mstar_core.config import ConfigSource
from mstar_core.errors import StateError
from mstar_core.kv import KVConfig, KVManager
from mstar_core.node import Node
from mstar_core.step import AttentionStep, KVSpan, KVStep, Step, StepContext
from mstar_core.testing.conformance import TOLERANCE
from mstar_core.testing.oracle import attention_oracle, rel_error

LABEL = "latent"
NOT_CAUSAL = AttentionStep(causal=False)


@dataclass(frozen=True)
class DenoiseShape:
    num_layers: int = 2
    num_qo_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    max_pages: int = 64
    prefixes: tuple[tuple[str, int], ...] = (("a", 40), ("b", 32))  # request, conditioning tokens
    fresh: tuple[tuple[str, int], ...] = (("a", 48), ("b", 24), ("c", 33))  # latent tokens per step
    fork: tuple[str, str] = ("c", "a")  # (new request, the request whose prefix it copies)
    reset: tuple[str, int] = ("b", 20)  # request whose conditioning is replaced, new length
    steps_before_fork: int = 2
    steps_after_fork: int = 1
    steps_after_reset: int = 2


@dataclass
class DenoiseReport:
    backend: str
    events: list[str] = field(default_factory=list)
    denoise_steps: int = 0
    max_error: float = 0.0
    tolerance: float = 0.0
    gathers: int = 0
    expected_gathers: int = 0
    hits: int = 0
    rebuilds: int = 0  # gathers of a stream whose earlier gather was invalidated

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance and self.gathers == self.expected_gathers

    def lines(self) -> list[str]:
        return [
            f"backend: {self.backend}",
            f"steps: {len(self.events)} ({', '.join(self.events)})",
            f"denoise steps: {self.denoise_steps}; largest relative error vs float64 full attention: "
            f"{self.max_error:.3g} (tolerance {self.tolerance:g})",
            f"prefix cache: {self.gathers} gathers (expected {self.expected_gathers}), {self.hits} hits, "
            f"{self.rebuilds} of them rebuilds (a stream's generation or prefix moved: fork, reset)",
            "OK" if self.ok else "MISMATCH",
        ]


class _Denoiser:
    """Drives the node and keeps the float64 truth of every stream's prefix, per layer."""

    def __init__(self, shape: DenoiseShape, wrapper_class: type, device: torch.device, dtype: torch.dtype,
                 seed: int) -> None:
        self.s = shape
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator().manual_seed(seed)
        cfg = KVConfig(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.max_pages,
                       num_qo_heads=shape.num_qo_heads)
        self.kv = KVManager(cfg, device, dtype)
        self.attn = DenseAttentionManager(self.kv, device, dtype, cfg, wrapper_class)
        self.node = Node([self.kv, self.attn])
        self.truth: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (rid, layer) -> k, v f64
        self.seen: dict[str, tuple[int, int]] = {}  # rid -> (generation, prefix) at its last denoise step
        self.max_error = 0.0
        self.expected_gathers = 0
        self.rebuilds = 0

    def _rand(self, n: int, heads: int) -> torch.Tensor:
        x = torch.randn((n, heads, self.s.head_dim), generator=self.gen)
        return x.to(self.device, self.dtype)

    def _run(self, step: Step, forward) -> StepContext:
        res = self.node.step(step, forward)
        if not res.outcome:
            raise StateError(f"step refused: {res.outcome.reason()}")
        return res.ctx

    def commit_prefix(self, rid: str, n: int) -> None:
        """One committed step of ``n`` conditioning tokens (attending among themselves)."""
        self.node.ingest_request(rid)
        step = Step(KVStep((KVSpan(rid, LABEL, n, commit=True),)), NOT_CAUSAL)

        def forward(ctx: StepContext) -> None:
            for layer in range(self.s.num_layers):
                q, k, v = (self._rand(n, self.s.num_qo_heads), self._rand(n, self.s.num_kv_heads),
                           self._rand(n, self.s.num_kv_heads))
                out = self.attn.run(q, LABEL, self.kv.layer_view(layer), k=k, v=v, layer_idx=layer)
                self._check(out, [(q, k.double(), v.double())])
                self.truth[(rid, layer)] = (k.double(), v.double())

        self._run(step, forward)

    def fork(self, new: str, src: str) -> None:
        """A new request whose stream is a copy of ``src``'s prefix pages (``KVManager.fork``:
        fresh pages, contents copied, no recomputation). Both streams get a new generation, so
        the source's gathered prefix is rebuilt too (a fork invalidates what was derived from
        the pages)."""
        self.node.ingest_request(new)
        outcome = self.kv.fork(src, new, LABEL)
        if not outcome:
            raise StateError(f"fork {src} -> {new}: {outcome.reason()}")
        for layer in range(self.s.num_layers):
            self.truth[(new, layer)] = self.truth[(src, layer)]

    def reset(self, rid: str, n: int) -> None:
        """Replace ``rid``'s conditioning: reset (pages freed, generation bumped), commit anew."""
        self.node.reset_request(rid)
        self.commit_prefix(rid, n)

    def denoise(self) -> None:
        fresh = [(r, n) for r, n in self.s.fresh if (r, LABEL) in self.kv.streams]
        step = Step(KVStep(tuple(KVSpan(r, LABEL, n, commit=False) for r, n in fresh)), NOT_CAUSAL)
        for r, _ in fresh:
            st = self.kv.stream(r, LABEL)
            key = (st.generation, st.length)
            if self.seen.get(r) != key:
                self.expected_gathers += self.s.num_layers  # one gather per layer for a new/moved prefix
                self.rebuilds += self.s.num_layers if r in self.seen else 0
                self.seen[r] = key
        total = sum(n for _, n in fresh)

        def forward(ctx: StepContext) -> None:
            for layer in range(self.s.num_layers):
                q, k, v = (self._rand(total, self.s.num_qo_heads), self._rand(total, self.s.num_kv_heads),
                           self._rand(total, self.s.num_kv_heads))
                out = self.attn.run(q, LABEL, self.kv.layer_view(layer), k=k, v=v, layer_idx=layer)
                rows, at = [], 0
                for r, n in fresh:
                    pk, pv = self.truth[(r, layer)]
                    rows.append((q[at:at + n], torch.cat([pk, k[at:at + n].double()]),
                                 torch.cat([pv, v[at:at + n].double()])))
                    at += n
                self._check(out, rows)

        self._run(step, forward)

    def _check(self, out: torch.Tensor, rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        ref = torch.cat([attention_oracle(q.double(), k, v, causal=False) for q, k, v in rows])
        self.max_error = max(self.max_error, rel_error(out, ref))


def run_denoise(wrapper_class: type, backend: str, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0,
                shape: DenoiseShape = DenoiseShape()) -> DenoiseReport:
    """Run the example through ``wrapper_class`` (a prefixed ragged wrapper) and report."""
    d = _Denoiser(shape, wrapper_class, torch.device(device), dtype, seed)
    rep = DenoiseReport(backend, tolerance=TOLERANCE[dtype])
    for rid, n in shape.prefixes:
        d.commit_prefix(rid, n)
        rep.events.append(f"commit prefix {rid}:{n}")
    for _ in range(shape.steps_before_fork):
        d.denoise()
        rep.events.append("denoise")
    new, src = shape.fork
    d.fork(new, src)
    rep.events.append(f"fork {new}<-{src}")
    for _ in range(shape.steps_after_fork):
        d.denoise()
        rep.events.append("denoise")
    rid, n = shape.reset
    d.reset(rid, n)
    rep.events.append(f"reset {rid} + commit prefix {rid}:{n}")
    for _ in range(shape.steps_after_reset):
        d.denoise()
        rep.events.append("denoise")
    st = d.attn.stats
    rep.denoise_steps = shape.steps_before_fork + shape.steps_after_fork + shape.steps_after_reset
    rep.max_error, rep.gathers, rep.hits = d.max_error, st.gathers, st.hits
    rep.expected_gathers, rep.rebuilds = d.expected_gathers, d.rebuilds
    d.node.cleanup()
    return rep


def main(backend: str | None = None, device: str = "cpu", seed: int = 0, config: ConfigSource = None) -> int:
    """``mstar demo --workload denoise``: pick the dense backend (by name, config, env or auto),
    run, print the report; 0 when every output matched and the cache behaved, else 1."""
    from mstar_core.registry import (
        select_backend,  # imports plugins: keep it out of module import
    )

    dev = torch.device(device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    shape = DenoiseShape()
    sel = select_backend(capabilities=(DENSE_CAPABILITY,), requested=backend, device=dev, dtype=dtype,
                         head_dim=shape.head_dim, config=config)
    cls = sel.classes[DENSE_CAPABILITY]
    report = run_denoise(cls, f"{sel.name} ({cls.__name__})", dev, dtype, seed, shape)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1
