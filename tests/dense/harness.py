"""A node of (KVManager, attention manager) driven through steps of random q/k/v, with the
float64 truth of every stream's committed K/V, so any backend's outputs can be checked against
full attention — and two backends' outputs against each other, since the data depend only on
the seed and the step sequence."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mstar_core.features import KV_DTYPES, PLAIN, AttentionFeatures, quantize
from mstar_core.kv import KVConfig, KVManager
from mstar_core.node import Node
from mstar_core.step import AttentionStep, KVSpan, KVStep, Step, StepContext
from mstar_core.testing.oracle import attention_oracle, rel_error

LABEL = "latent"


class Harness:
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
        # Sink logits per layer, where the features ask for them.
        self.sinks = [torch.randn(hq, generator=self.gen).to(self.device) * 2 for _ in range(layers)] \
            if features.sink_logits else None

    def _stored(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache gives back of committed ``k``/``v`` (FP8: quantised, then scaled)."""
        fp8 = KV_DTYPES[self.features.kv_dtype]
        if fp8 is None:
            return k.double().cpu(), v.double().cpu()
        ks, vs = self.features.scales(layer)
        return (quantize(k, ks, fp8).double().cpu() * ks, quantize(v, vs, fp8).double().cpu() * vs)

    def ingest(self, *rids: str) -> None:
        for r in rids:
            self.node.ingest_request(r)

    def _rand(self, n: int, h: int) -> torch.Tensor:
        return torch.randn((n, h, self.cfg.head_dim), generator=self.gen).to(self.device, self.dtype)

    def step(self, spans: Sequence[tuple], causal: bool = False, window_left: int = -1) -> tuple[float, list[torch.Tensor]]:
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
                    q, k, v = self._rand(total, self.cfg.qo_heads), self._rand(total, self.cfg.num_kv_heads), self._rand(total, self.cfg.num_kv_heads)
                    if self.attn.requires_kv_write:
                        self.kv.write_kv(k, v, layer_idx=layer, label=lab)
                    sinks = None if self.sinks is None else self.sinks[layer]
                    out = self.attn.run(q, lab, self.kv.layer_view(layer), k=k, v=v, layer_idx=layer,
                                        **({} if sinks is None else {"sinks": sinks}))
                    window = self.features.window(layer, window_left)
                    outs.append(out)
                    refs, at = [], 0
                    for r, n in rows:
                        pk, pv = self.truth.get((r, lab, layer), (torch.zeros(0, self.cfg.num_kv_heads, self.cfg.head_dim, dtype=torch.float64),) * 2)
                        kk, vv = torch.cat([pk, k[at:at + n].double().cpu()]), torch.cat([pv, v[at:at + n].double().cpu()])
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
                            pk, pv = self.truth.get((r, lab, layer), (torch.zeros(0, self.cfg.num_kv_heads, self.cfg.head_dim, dtype=torch.float64),) * 2)
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
