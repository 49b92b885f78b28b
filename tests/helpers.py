"""Builders shared by the test modules (imported relatively: ``from ..helpers import small_kv``):
paths, step builders, the reference wrappers and small managers, the tiny decoder under a
GraphRunner, a lifecycle-logging resource, paged conformance cases, the dense-path harness (a
node driven with random q/k/v against the float64 truth), the bounded KV manager's
keep-everything oracle and scenario driver, and the GPU tests' result files."""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mstar_core import (
    AdmitOutcome,
    AttentionFeatures,
    AttentionStep,
    BoundedKVConfig,
    BoundedKVManager,
    BoundedStep,
    DenseAttentionManager,
    GraphRunner,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Resource,
    Shortage,
    Step,
    StepContext,
    StreamPosition,
)
from mstar_core.backends import reference as R
from mstar_core.demo import TinyDecoder, TinyDecoderConfig
from mstar_core.features import KV_DTYPES, PLAIN
from mstar_core.kv.fp8 import quantize
from mstar_core.testing import conformance as C
from mstar_core.testing.environment import environment
from mstar_core.testing.oracle import attention_oracle, rel_error

REPO = pathlib.Path(__file__).resolve().parents[1]
STANDINS = REPO / "tests" / "standins"  # stand-in kernel libraries, put on sys.path only by fixtures

REF_WRAPPERS = {
    "paged_prefill": R.ReferencePrefillWrapper,
    "paged_decode": R.ReferenceDecodeWrapper,
    "mixed": R.ReferenceMixedWrapper,
}


# -- steps ---------------------------------------------------------------------------------------


def step(*spans) -> Step:
    """A KV step of ``(rid, label, n[, commit])`` spans."""
    return Step(KVStep(tuple(KVSpan(*s) for s in spans)))


def run_step(kv: KVManager, st: Step, k: torch.Tensor | None = None, layer: int = 0):
    """Admit, plan and commit ``st`` on ``kv`` alone (writing ``k`` and ``-k`` at ``layer`` when
    given); returns the plan."""
    ctx = StepContext()
    assert kv.admit(st, ctx)
    plan = kv.plan(st, ctx)
    if k is not None:
        kv.write_kv(k, -k, layer, st.kv.spans[0].label)
    kv.commit(st, ctx)
    return plan


def bstep(*spans) -> Step:
    """A bounded step: each span is a ``StreamPosition`` or its arguments ``(rid, n[, start, ...])``."""
    positions = tuple(s if isinstance(s, StreamPosition) else StreamPosition(*s) for s in spans)
    return Step(KVStep(()), extra=(("bounded", BoundedStep(positions)),))


def bounded_step_through(mgr: BoundedKVManager, rid: str, n: int, commit: bool = True) -> None:
    """A bounded step of ``n`` tokens of ``rid`` that wrote its keys into the ring (layer 0), then
    committed -- or was rolled back (a later layer failed), leaving its writes abandoned."""
    s = bstep((rid, n))
    ctx = StepContext()
    assert mgr.admit(s, ctx)
    cfg = mgr.config
    q = torch.randn(cfg.rows, cfg.num_heads, n, cfg.head_dim, dtype=torch.float64)
    mgr.attend(0, q, q, q, plan=mgr.plan(s, ctx))
    (mgr.commit if commit else mgr.rollback_admit)(s, ctx)


# -- small managers ------------------------------------------------------------------------------


def small_kv(max_pages=8, page_size=4, layers=2, hkv=2, hq=4, d=8, dtype=torch.float64, requests=()) -> KVManager:
    """A small CPU paged KV manager, with ``requests`` ingested."""
    cfg = KVConfig(layers, hkv, d, page_size, max_pages, hq)
    kv = KVManager(cfg, "cpu", dtype)
    for r in requests:
        kv.ingest_request(r)
    return kv


def tiny_graph_node(graphs=True, slots=2, buckets=(2, 4), max_pages=64, layers=2, hidden=64, head_dim=16, seed=3):
    """The tiny decoder over a paged KV manager and paged attention (reference wrappers), in one
    Node under a GraphRunner (not warmed up). Returns (model, kv, attn, node, runner)."""
    cfg = TinyDecoderConfig(num_layers=layers, hidden=hidden, mlp=2 * hidden, num_qo_heads=4, num_kv_heads=2,
                            head_dim=head_dim)
    model = TinyDecoder(cfg, "cpu", torch.float64, seed=seed)
    kvc = KVConfig(layers, 2, head_dim, 4, max_pages, 4)
    kv = KVManager(kvc, "cpu", torch.float64)
    attn = PagedAttentionManager(kv, "cpu", torch.float64, kvc, REF_WRAPPERS, accelerator_graph=graphs)
    node = Node([kv, attn])
    forward = model.step_forward(kv, attn)
    return model, kv, attn, node, GraphRunner(node, forward, buckets=list(buckets), device="cpu", slots=slots)


def multi_token_graph_node(query_tokens=4, features=None, wrappers=REF_WRAPPERS, layers=2, head_dim=16,
                           dtype=torch.float64, device="cpu", multi_token_wrapper="paged_prefill"):
    """The tiny decoder over paged KV and attention whose decode rows carry ``query_tokens``
    tokens each (on ``multi_token_wrapper``), under a GraphRunner (buckets 2 and 4, not warmed
    up). Returns (model, kv, attn, node, runner)."""
    cfg = TinyDecoderConfig(num_layers=layers, hidden=64, mlp=128, num_qo_heads=4, num_kv_heads=2, head_dim=head_dim)
    model = TinyDecoder(cfg, device, dtype, seed=5)
    features = features or AttentionFeatures(decode_query_tokens=query_tokens)
    kvc = KVConfig(layers, 2, head_dim, 16 if device == "cuda" else 4, 64, 4)
    kv = KVManager(kvc, device, dtype, features=features)
    attn = PagedAttentionManager(kv, device, dtype, kvc, wrappers, accelerator_graph=True,
                                 multi_token_wrapper=multi_token_wrapper)
    node = Node([kv, attn])
    runner = GraphRunner(node, model.step_forward(kv, attn), buckets=[2, 4], device=device, query_tokens=query_tokens)
    return model, kv, attn, node, runner


def verify_multi_token_decode(model, node, runner, t, steps=4, atol=1e-9):
    """Prompts, then ``steps`` graph steps of ``t`` tokens per row (pre-planned one ahead);
    every token's logits against the full forward of its sequence (``atol`` None: a relative
    error within bf16's tolerance)."""
    prompts = {"a": [1, 2, 3, 4, 5], "b": [7, 8], "c": [9, 10, 11, 12, 13, 14, 15]}
    seqs = {r: list(p) for r, p in prompts.items()}
    for r in prompts:
        node.ingest_request(r)
    dev = runner.device
    prep = runner.prepare(Step(KVStep(tuple(KVSpan(r, "text", len(p)) for r, p in prompts.items()))))
    assert prep.graph is None
    runner.launch(prep, torch.tensor([x for p in prompts.values() for x in p], device=dev))
    gen = torch.Generator().manual_seed(0)
    step = Step(KVStep(tuple(KVSpan(r, "text", t) for r in prompts)))
    prep = runner.prepare(step)
    slots, outs = [], []
    for _ in range(steps):
        assert prep.graph is not None and prep.ctx.bucket == 4 and prep.ctx.graph_tokens == 4 * t
        slots.append(prep.ctx.slot)
        drafts = torch.randint(0, 50, (len(prompts), t), generator=gen)
        out = runner.launch(prep, drafts.flatten().to(dev))
        prep = runner.prepare(step)  # pre-plan step N+1 before step N's output is read
        assert out.shape[0] == len(prompts) * t
        for i, r in enumerate(prompts):
            start = len(seqs[r])
            seqs[r].extend(drafts[i].tolist())
            full = model.forward_full(torch.tensor(seqs[r], device=dev))
            outs.append((out[i * t:(i + 1) * t].clone(), full[start:start + t]))
    runner.discard(prep)
    assert slots == [0, 1, 0, 1]
    for got, want in outs:
        if atol is None:
            assert rel_error(got, want.double().cpu()) < 3e-2
        else:
            assert torch.allclose(got, want, atol=atol)


class Logged(Resource):
    """A resource that logs its lifecycle calls into a shared list; refuses its admit, or raises
    in its commit, on cue."""

    def __init__(self, name, log, deps=(), refuse=False, fail_commit=False):
        self.name, self.log, self.deps = name, log, tuple(deps)
        self.refuse, self.fail_commit = refuse, fail_commit

    def depends_on(self):
        return self.deps

    def admit(self, step, ctx):
        self.log.append(("admit", self.name))
        if self.refuse:
            return AdmitOutcome.refuse(Shortage(self.name, "tickets", 1, 0))
        return AdmitOutcome.ok()

    def rollback_admit(self, step, ctx):
        self.log.append(("rollback", self.name))

    def commit(self, step, ctx):
        self.log.append(("commit", self.name))
        if self.fail_commit:
            raise OSError("disk full")


# -- attention features ----------------------------------------------------------------------------


def stored(features: AttentionFeatures, layer: int, k: torch.Tensor, v: torch.Tensor):
    """What a kernel reads back of ``k``/``v`` written to ``layer`` (FP8: quantised, then scaled)."""
    fp8 = KV_DTYPES[features.kv_dtype]
    if fp8 is None:
        return k.double(), v.double()
    ks, vs = features.scales(layer)
    return quantize(k, ks, fp8).double() * ks, quantize(v, vs, fp8).double() * vs


# -- paged conformance cases ---------------------------------------------------------------------


def case(q_lens, prefix_lens, page_size=4, head_dim=16, gqa=2, causal=True, seed=0, window_left=-1) -> C.PagedCase:
    return C.PagedCase(page_size, head_dim, gqa, tuple(q_lens), tuple(prefix_lens), causal=causal, seed=seed,
                       window_left=window_left)


def oracle(c: C.PagedCase, data: C.PagedData) -> torch.Tensor:
    return C.paged_oracle(c, data, c.causal)


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return rel_error(out, ref)


def shifted(data: C.PagedData, pages_extra: int) -> C.PagedData:
    """The same case with every page id moved up by ``pages_extra`` (page 0.. left to the caller,
    e.g. as a poisoned sink page)."""
    layer = torch.cat([torch.full((pages_extra, *data.layer.shape[1:]), 1e4, dtype=data.layer.dtype), data.layer])
    return C.PagedData(data.q, layer, data.qo_indptr, data.kv_indptr, data.kv_indices + pages_extra,
                       data.last_page_len, data.kv_lens, data.keys)


def fa3_feature_cases() -> list:
    """The ragged feature cases of every feature the FA3 backend declares."""
    from mstar_fa3.plugin import FA3

    return C.ragged_feature_cases(FA3.supports("prefixed_ragged"))


# -- the dense-path harness ----------------------------------------------------------------------

LABEL = "latent"


def dense(wrapper=R.ReferencePrefixedPrefillWrapper, **kw):
    """A Harness ``make_attn``: a DenseAttentionManager on ``wrapper`` over the harness's cache."""
    return lambda kv, cfg: DenseAttentionManager(kv, kv.device, kv.dtype, cfg, wrapper, **kw)


class Harness:
    """A node of (KVManager, attention manager) driven through steps of random q/k/v, with the
    float64 truth of every stream's committed K/V, so any backend's outputs can be checked against
    full attention — and two backends' outputs against each other, since the data depend only on
    the seed and the step sequence."""

    def __init__(self, make_attn: Callable[[KVManager, KVConfig], object], dtype: torch.dtype = torch.float32,
                 layers: int = 2, hkv: int = 2, hq: int = 4, d: int = 32, page_size: int = 16,
                 max_pages: int = 64, seed: int = 0, device: str = "cpu",
                 features: AttentionFeatures = PLAIN) -> None:
        self.cfg = KVConfig(layers, hkv, d, page_size, max_pages, hq)
        self.dtype = dtype
        self.device = torch.device(device)
        self.features = features
        self.kv = KVManager(self.cfg, self.device, dtype, features=features)
        self.attn = make_attn(self.kv, self.cfg)
        self.node = Node([self.kv, self.attn])
        self.gen = torch.Generator().manual_seed(seed)
        self.truth: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Sink logits per layer, where the features ask for them (None for a layer without).
        self.sinks = [torch.randn(hq, generator=self.gen).to(self.device) * 2 if features.layer_sinks(i) else None
                      for i in range(layers)] if features.any_sinks else None

    def _stored(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache gives back of committed ``k``/``v`` (FP8: quantised, then scaled)."""
        sk, sv = stored(self.features, layer, k, v)
        return sk.cpu(), sv.cpu()

    def ingest(self, *rids: str) -> None:
        for r in rids:
            self.node.ingest_request(r)

    def _rand(self, n: int, h: int) -> torch.Tensor:
        return torch.randn((n, h, self.cfg.head_dim), generator=self.gen).to(self.device, self.dtype)

    def _truth(self, rid: str, label: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.zeros(0, self.cfg.num_kv_heads, self.cfg.head_dim, dtype=torch.float64)
        return self.truth.get((rid, label, layer), (empty, empty))

    def step(self, spans: Sequence[tuple], causal: bool = False,
             window_left: int = -1) -> tuple[float, list[torch.Tensor]]:
        """``spans``: ``(rid, n, commit)`` or ``(rid, label, n, commit)``. Returns the largest
        relative error against the oracle and every layer's output per label (in order)."""
        full = [s if len(s) == 4 else (s[0], LABEL, s[1], s[2]) for s in spans]
        step = Step(KVStep(tuple(KVSpan(r, lab, n, c) for r, lab, n, c in full)), AttentionStep(causal, window_left))
        labels = list(dict.fromkeys(lab for _, lab, _, _ in full))
        errs: list[float] = []
        outs: list[torch.Tensor] = []

        def forward(ctx: StepContext) -> None:
            for layer in range(self.cfg.num_layers):
                for lab in labels:
                    rows = [(r, n) for r, l2, n, _ in full if l2 == lab]
                    total = sum(n for _, n in rows)
                    hkv = self.cfg.num_kv_heads
                    q, k, v = self._rand(total, self.cfg.qo_heads), self._rand(total, hkv), self._rand(total, hkv)
                    if self.attn.requires_kv_write:
                        self.kv.write_kv(k, v, layer_idx=layer, label=lab)
                    sinks = None if self.sinks is None else self.sinks[layer]
                    out = self.attn.run(q, lab, self.kv.layer_view(layer), k=k, v=v, layer_idx=layer,
                                        **({} if sinks is None else {"sinks": sinks}))
                    window = self.features.window(layer, window_left)
                    outs.append(out)
                    refs, at = [], 0
                    for r, n in rows:
                        pk, pv = self._truth(r, lab, layer)
                        kk = torch.cat([pk, k[at:at + n].double().cpu()])
                        vv = torch.cat([pv, v[at:at + n].double().cpu()])
                        refs.append(attention_oracle(q[at:at + n].double(), kk, vv, causal, window,
                                                     None, self.features.soft_cap, sinks))
                        at += n
                    if refs:
                        errs.append(rel_error(out, torch.cat(refs)))
                    # what a committed span leaves in the cache
                    at = 0
                    for r, l2, n, c in full:
                        if l2 != lab:
                            continue
                        if c:
                            pk, pv = self._truth(r, lab, layer)
                            sk, sv = self._stored(layer, k[at:at + n], v[at:at + n])
                            self.truth[(r, lab, layer)] = (torch.cat([pk, sk]), torch.cat([pv, sv]))
                        at += n

        res = self.node.step(step, forward)
        assert res.outcome, res.outcome.reason()
        return max(errs, default=0.0), outs

    def reset(self, rid: str) -> None:
        self.node.reset_request(rid)
        for key in [k for k in self.truth if k[0] == rid]:
            del self.truth[key]


# -- the bounded KV manager's oracle and scenario driver ----------------------------------------


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
    """``||a - b|| / ||b||`` in float64 on the host, for tensors on any device; ``a`` must be finite."""
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
        for i, (rid, n) in enumerate(zip(rids, spans, strict=True)):
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


def make_scenario(cfg: BoundedKVConfig, device="cpu", dtype=torch.float32, **kw) -> Scenario:
    mgr = BoundedKVManager(cfg, device, kv_dtype=dtype)
    return Scenario(cfg, mgr, StreamOracle(cfg), device=device, dtype=dtype, **kw)


def run_long(sc: Scenario, n_steps: int, max_span: int) -> None:
    """Three requests over many steps: decode (T = 1), prefill chunks longer than the window,
    uneven spans in one batch, now and then a commit=False pass and a request missing a step."""
    rng = random.Random(sc.seed + 1)
    rids = ["a", "b", "c"]
    for _ in range(n_steps):
        batch = [r for r in rids if rng.random() < 0.85] or ["a"]
        kind = rng.random()
        if kind < 0.5:
            spans = [1] * len(batch)
        else:
            spans = [rng.randint(0, max_span) for _ in batch]
        commit = [rng.random() > 0.1 for _ in batch]
        sc.step(batch, spans, commit=commit)


# -- transformers ------------------------------------------------------------------------------


def install_decode_backend(fake_module, monkeypatch, name: str, cls: type) -> None:
    """A third-party backend ``name`` providing ``paged_decode`` alone (``cls``, importable as
    ``<name>_mstar:<cls name>``) beside the reference, as the process-wide registry."""
    from mstar_core import BackendSpec, Registry
    from mstar_core.backends.reference.plugin import REFERENCE

    fake_module(f"{name}_mstar", **{cls.__name__: cls})
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0")
    reg.register(BackendSpec(name=name, provides={"paged_decode": f"{name}_mstar:{cls.__name__}"},
                             devices=("cpu",), dtypes=(torch.float32,), api_version="1.1"),
                 distribution=f"{name}-mstar", version="0.1")
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)
    monkeypatch.delenv("MSTAR_ATTENTION_BACKEND", raising=False)


def hf_greedy(model, prompt: list[int], new: int, **kw) -> list[int]:
    """transformers' own greedy generation of ``new`` tokens, eager attention, one prompt at a time
    (the model's attention implementation is restored afterwards)."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, **kw)
    finally:
        model.set_attn_implementation(before)
    return out[0, len(prompt):].tolist()


# -- GPU result files ----------------------------------------------------------------------------


def write_results(name: str, results: list[dict], distributions: tuple[str, ...]) -> None:
    """What a GPU test measured, to ``$OUT/<name>.json`` (nothing without ``OUT``), with the device
    and the versions of the libraries that ran."""
    out = os.environ.get("OUT")
    if not out or not results:
        return
    info = environment(*distributions)
    p = pathlib.Path(out) / f"{name}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"info": info, "results": results}, indent=1))
