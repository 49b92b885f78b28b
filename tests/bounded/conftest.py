"""Shared helpers for the bounded KV tests: a keep-everything oracle, a scenario driver, and the
Triton kernel loaded under the interpreter."""

from __future__ import annotations

import importlib.util
import math
import os
import random
import sys
from dataclasses import dataclass, field

import pytest
import torch

import mstar_core.kernels.bounded_attention as ba
from mstar_core.kv.bounded import BoundedKVConfig, BoundedKVManager, BoundedStep, StreamPosition
from mstar_core.step import KVStep, Step, StepContext


class StreamOracle:
    """Keeps every token of every stream (per layer) and masks, in float64, to what the
    bounded cache is documented to retain. Written per request, for clarity."""

    def __init__(self, cfg: BoundedKVConfig) -> None:
        self.cfg = cfg
        self.hist: dict[tuple[str, int], torch.Tensor] = {}  # [rows, H, n, 2D] float64

    def forget(self, rid: str) -> None:
        for key in [k for k in self.hist if k[0] == rid]:
            del self.hist[key]

    def attend(self, layer, positions, q, k, v, source=None, row_source=None, rel_bias=None, sm_scale=None):
        cfg = self.cfg
        rows, H, D = cfg.rows, cfg.num_heads, cfg.head_dim
        BR, Hq, T, _ = q.shape
        G = Hq // H
        scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
        out = torch.zeros(BR, T, Hq, D, dtype=torch.float64)
        f64 = lambda x: x.detach().to("cpu", torch.float64)  # noqa: E731
        for b, (rid, start, n, src, src_len, commit) in enumerate(positions):
            sl = slice(b * rows, (b + 1) * rows)
            hist = self.hist.get((rid, layer), torch.zeros(rows, H, 0, 2 * D, dtype=torch.float64))
            assert hist.shape[2] == start, (rid, hist.shape, start)
            own = torch.cat([f64(k[sl, :, :n]), f64(v[sl, :, :n])], dim=-1)
            stream = torch.cat([hist, own], dim=2)  # every position 0 .. start + n - 1
            if commit:
                self.hist[(rid, layer)] = stream
            if n == 0:
                continue
            prefix = torch.zeros(rows, H, 0, 2 * D, dtype=torch.float64)
            if src is not None and src >= 0:
                prefix = f64(source[src])
            elif src == -1:
                prefix = f64(row_source[0][int(row_source[1][b])])
            if src is not None and src_len is not None:
                prefix = prefix[:, :, :src_len]
            qpos = torch.arange(start, start + n)[:, None]
            kpos = torch.arange(start + n)[None, :]
            seen = kpos <= qpos
            if cfg.query_window is None:
                seen &= (kpos < cfg.sink) | (kpos >= start - cfg.window)
            else:
                seen &= (kpos < cfg.sink) | (qpos - kpos <= cfg.query_window)
            keys = torch.cat([prefix, stream], dim=2).repeat_interleave(G, dim=1)
            kk, vv = keys[..., :D], keys[..., D:]
            s = torch.einsum("rhtd,rhnd->rhtn", f64(q[sl, :, :n]), kk) * scale
            lp = prefix.shape[2]
            if rel_bias is not None:
                nb = rel_bias.shape[-1]
                dist = (qpos - kpos).clamp(0, nb - 1)  # [n, N]
                rb = f64(rel_bias[sl, :, :n])
                s[..., lp:] += torch.gather(rb, 3, dist.expand(rows, Hq, n, -1))
            mask = torch.cat([torch.ones(n, lp, dtype=torch.bool), seen], dim=1)
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            out[sl, :n] = torch.einsum("rhtn,rhnd->rthd", p, vv)
        return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    assert torch.isfinite(a64).all()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item()


@dataclass
class Scenario:
    """Random steps over a few requests, driven through a manager and the oracle together."""

    cfg: BoundedKVConfig
    mgr: BoundedKVManager
    oracle: StreamOracle
    gqa: int = 1
    sources: int = 0  # number of shared prefixes (0: none)
    row_source: bool = False
    rel_bias: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    ieee: bool = False
    outputs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.gen = torch.Generator().manual_seed(self.seed)
        c = self.cfg
        self.source_t = self._rand(max(self.sources, 1), c.rows, c.num_heads, 5, 2 * c.head_dim)
        self.row_store = self._rand(6, c.rows, c.num_heads, 4, 2 * c.head_dim)

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def step(self, rids, spans, commit=None, check=True, tol=1e-5):
        c = self.cfg
        positions, oracle_pos = [], []
        for i, (rid, n) in enumerate(zip(rids, spans)):
            src = None
            choices = [None] + list(range(self.sources)) + ([-1] if self.row_source else [])
            src = self.rng.choice(choices)
            slen = self.rng.choice([None, self.rng.randint(0, 4)]) if src is not None else None
            cm = True if commit is None else commit[i]
            positions.append(StreamPosition(rid, n, start=self.mgr.length(rid), source=src, source_len=slen, commit=cm))
            oracle_pos.append((rid, self.mgr.length(rid), n, src, slen, cm))
        step = Step(kv=KVStep(()), extra=(("bounded", BoundedStep(tuple(positions))),))
        ctx = StepContext()
        for rid in rids:
            self.mgr.ingest_request(rid)
        outcome = self.mgr.admit(step, ctx)
        assert outcome, outcome.reason()
        plan = self.mgr.plan(step, ctx)
        B, T = len(rids), max(max(spans), 1)
        Hq = c.num_heads * self.gqa
        row_slots = torch.tensor([self.rng.randrange(6) for _ in rids], device=self.device)
        outs = []
        for layer in range(c.num_layers):
            q = self._rand(B * c.rows, Hq, T, c.head_dim)
            k = self._rand(B * c.rows, c.num_heads, T, c.head_dim)
            v = self._rand(B * c.rows, c.num_heads, T, c.head_dim)
            nb = (c.window + 1) if c.query_window is not None else self.rng.randint(1, c.window + T + 2)
            bias = self._rand(B * c.rows, Hq, T, nb) if self.rel_bias else None
            src = self.source_t if self.sources else None
            rs = (self.row_store, row_slots) if self.row_source else None
            out = self.mgr.attend(layer, q, k, v, source=src, plan=plan, rel_bias=bias, ieee=self.ieee, row_source=rs)
            want = self.oracle.attend(layer, oracle_pos, q, k, v, source=src, row_source=rs, rel_bias=bias)
            assert out.shape == (B * c.rows, T, Hq, c.head_dim)
            if check:
                err = rel_err(out, want)
                assert err < tol, f"layer {layer}: rel error {err:.3g} (positions {oracle_pos})"
            outs.append(out)
        self.mgr.commit(step, ctx)
        self.outputs.append(outs)
        return outs


def make(cfg: BoundedKVConfig, device="cpu", dtype=torch.float32, **kw) -> Scenario:
    mgr = BoundedKVManager(cfg, device, kv_dtype=dtype)
    return Scenario(cfg, mgr, StreamOracle(cfg), device=device, dtype=dtype, **kw)


def run_long(sc: Scenario, n_steps: int, max_span: int) -> None:
    """Three requests over many steps: decode (T = 1), prefill chunks longer than the window,
    uneven spans in one batch, now and then a commit=False pass and a request missing a step."""
    rng = random.Random(sc.seed + 1)
    rids = ["a", "b", "c"]
    for i in range(n_steps):
        batch = [r for r in rids if rng.random() < 0.85] or ["a"]
        kind = rng.random()
        if kind < 0.5:
            spans = [1] * len(batch)
        else:
            spans = [rng.randint(0, max_span) for _ in batch]
        commit = [rng.random() > 0.1 for _ in batch]
        sc.step(batch, spans, commit=commit)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: intra-op threads only add contention on a shared 2-core machine.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def triton_interp():
    """The Triton kernels, loaded a second time under the interpreter (runs on CPU tensors).

    The interpreter must be switched on before triton itself is imported (triton.language's
    own helpers are decorated then), so this runs only where nothing imported triton yet, and
    only without a GPU: the GPU tests run the compiled kernel, and the switch stays on."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/bounded/test_gpu_bounded.py runs the compiled kernel")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before the interpreter could be switched on")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    spec = importlib.util.spec_from_file_location(
        "mstar_bounded_triton_interp", os.path.join(ba.__path__[0], "triton_kernel.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert isinstance(mod._bounded_fwd, InterpretedFunction), "kernel was not loaded under the interpreter"
    return mod


class _Helpers:
    StreamOracle = StreamOracle
    Scenario = Scenario
    make = staticmethod(make)
    run_long = staticmethod(run_long)
    rel_err = staticmethod(rel_err)


@pytest.fixture(scope="session")
def bk():
    """The helpers above, for test modules (importlib import mode: no sibling imports)."""
    return _Helpers
