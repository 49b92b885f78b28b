"""A tiny decoder with random weights: RMSNorm, GQA attention with rotary positions, a gated
MLP. Two forwards compute the same function: ``forward_step`` through an attention manager and
the KV resource (any backend), ``forward_full`` over a whole sequence with no cache at all —
the demo checks one against the other."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..resources.attn.base import AttentionManager
from ..resources.kv.paged import KVManager


@dataclass(frozen=True)
class TinyDecoderConfig:
    vocab_size: int = 256
    hidden: int = 256
    num_layers: int = 2
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    mlp: int = 512
    rope_theta: float = 10000.0


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x [tokens, heads, D]`` at integer ``positions [tokens]``."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyDecoder:
    def __init__(self, cfg: TinyDecoderConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        g = torch.Generator().manual_seed(seed)
        h, qd, kd = cfg.hidden, cfg.num_qo_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def w(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(shape, generator=g) * scale).to(self.device, dtype)

        self.embed = w(cfg.vocab_size, h, scale=1.0)
        self.layers = [
            dict(
                norm1=torch.ones(h, device=self.device, dtype=dtype), wq=w(h, qd, scale=h ** -0.5),
                wk=w(h, kd, scale=h ** -0.5), wv=w(h, kd, scale=h ** -0.5), wo=w(qd, h, scale=qd ** -0.5),
                norm2=torch.ones(h, device=self.device, dtype=dtype), w1=w(h, cfg.mlp, scale=h ** -0.5),
                w3=w(h, cfg.mlp, scale=h ** -0.5), w2=w(cfg.mlp, h, scale=cfg.mlp ** -0.5),
            )
            for _ in range(cfg.num_layers)
        ]
        self.norm = torch.ones(h, device=self.device, dtype=dtype)
        self.head = w(h, cfg.vocab_size, scale=h ** -0.5)

    def _qkv(self, x: torch.Tensor, p: dict, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.cfg
        hn = _rms(x, p["norm1"])
        q = (hn @ p["wq"]).view(-1, c.num_qo_heads, c.head_dim)
        k = (hn @ p["wk"]).view(-1, c.num_kv_heads, c.head_dim)
        v = (hn @ p["wv"]).view(-1, c.num_kv_heads, c.head_dim)
        return _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta), v

    def _mlp(self, x: torch.Tensor, p: dict) -> torch.Tensor:
        hn = _rms(x, p["norm2"])
        return x + (F.silu(hn @ p["w1"]) * (hn @ p["w3"])) @ p["w2"]

    def forward_step(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVManager,
                     attn: AttentionManager, label: str | None = None) -> torch.Tensor:
        """Logits ``[tokens, vocab]`` for this step's packed tokens of ``label``. The layer is
        written once for every backend (seed 000)."""
        x = self.embed[tokens]
        for i, p in enumerate(self.layers):
            q, k, v = self._qkv(x, p, positions)
            if attn.requires_kv_write:
                kv.write_kv(k, v, layer_idx=i, label=label)
            o = attn.run(q, label, kv.layer_view(i), k=k, v=v, layer_idx=i)
            x = x + o.reshape(len(tokens), -1) @ p["wo"]
            x = self._mlp(x, p)
        return _rms(x, self.norm) @ self.head

    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` of one whole sequence, causal, no cache."""
        c = self.cfg
        n = len(tokens)
        positions = torch.arange(n, device=self.device)
        x = self.embed[tokens]
        g = c.num_qo_heads // c.num_kv_heads
        for p in self.layers:
            q, k, v = self._qkv(x, p, positions)
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = x + o.transpose(0, 1).reshape(n, -1) @ p["wo"]
            x = self._mlp(x, p)
        return _rms(x, self.norm) @ self.head
