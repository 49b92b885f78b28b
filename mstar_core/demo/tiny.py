"""A tiny decoder with random weights: RMSNorm, GQA attention with rotary positions, a gated
MLP. Two forwards compute the same function: ``forward_step`` through an attention manager and
the KV resource (any backend), ``forward_full`` over a whole sequence with no cache at all —
the demo checks one against the other.

Given a :class:`~mstar_core.distributed.TensorParallel`, the model is sharded Megatron-style:
each rank holds its slice of the query and KV heads (column-parallel ``wq``/``wk``/``wv``, a
row-parallel ``wo``) and of the MLP (column-parallel ``w1``/``w3``, row-parallel ``w2``), and each
block -- attention, MLP -- ends in one all-reduce of its partial output. Embedding, norms and the
head are replicated. Every rank draws the full weights from the same seed and keeps its slice,
so a sharded model computes the function of the unsharded one with the same seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar_core.attention.base import AttentionManager
from mstar_core.compiling import CompiledForward, CompileOptions
from mstar_core.distributed import TensorParallel, check_shardable
from mstar_core.kv.paged import KVManager
from mstar_core.step import StepContext


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
                 dtype: torch.dtype = torch.float32, seed: int = 0, tp: TensorParallel | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = tp
        world = tp.world_size if tp is not None else 1
        check_shardable(world, cfg.num_qo_heads, cfg.num_kv_heads, cfg.mlp)
        # The heads this rank holds (its slice of the MLP likewise).
        self.num_qo_heads, self.num_kv_heads = cfg.num_qo_heads // world, cfg.num_kv_heads // world
        # On CUDA the weights are drawn on the device: a bench-sized model drawn on the host takes
        # seconds per rank. The numbers can depend on the GPU model (the generator's launch shape
        # follows the SM count), so a sharded model assumes its ranks' GPUs are alike, as TP ranks are.
        gen_dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        g = torch.Generator(gen_dev).manual_seed(seed)
        h, qd, kd = cfg.hidden, cfg.num_qo_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def w(*shape: int, scale: float, split: int | None = None) -> torch.Tensor:
            full = torch.randn(shape, generator=g, device=gen_dev) * scale
            # Every rank draws the whole tensor (same generator state) and keeps its slice.
            return (tp.shard(full, split) if tp is not None and split is not None else full).to(self.device, dtype)

        self.embed = w(cfg.vocab_size, h, scale=1.0)
        self.layers = [
            dict(
                norm1=torch.ones(h, device=self.device, dtype=dtype), wq=w(h, qd, scale=h ** -0.5, split=1),
                wk=w(h, kd, scale=h ** -0.5, split=1), wv=w(h, kd, scale=h ** -0.5, split=1),
                wo=w(qd, h, scale=qd ** -0.5, split=0),
                norm2=torch.ones(h, device=self.device, dtype=dtype), w1=w(h, cfg.mlp, scale=h ** -0.5, split=1),
                w3=w(h, cfg.mlp, scale=h ** -0.5, split=1), w2=w(cfg.mlp, h, scale=cfg.mlp ** -0.5, split=0),
            )
            for _ in range(cfg.num_layers)
        ]
        self.norm = torch.ones(h, device=self.device, dtype=dtype)
        self.head = w(h, cfg.vocab_size, scale=h ** -0.5)

    def _qkv(self, x: torch.Tensor, p: dict, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.cfg
        hn = _rms(x, p["norm1"])
        q = (hn @ p["wq"]).view(-1, self.num_qo_heads, c.head_dim)
        k = (hn @ p["wk"]).view(-1, self.num_kv_heads, c.head_dim)
        v = (hn @ p["wv"]).view(-1, self.num_kv_heads, c.head_dim)
        return _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta), v

    def _reduce(self, partial: torch.Tensor, what: str) -> torch.Tensor:
        """A row-parallel block's output: the sum of every rank's partial (the block's one all-reduce)."""
        return self.tp.all_reduce(partial, what) if self.tp is not None else partial

    def _attn_out(self, x: torch.Tensor, o: torch.Tensor, p: dict) -> torch.Tensor:
        return x + self._reduce(o.reshape(x.shape[0], -1) @ p["wo"], "the attention all-reduce")

    def _mlp(self, x: torch.Tensor, p: dict) -> torch.Tensor:
        hn = _rms(x, p["norm2"])
        return x + self._reduce((F.silu(hn @ p["w1"]) * (hn @ p["w3"])) @ p["w2"], "the MLP all-reduce")

    def forward_step(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVManager,
                     attn: AttentionManager, label: str | None = None) -> torch.Tensor:
        """Logits ``[tokens, vocab]`` for this step's packed tokens of ``label``. The layer is
        written once for every backend."""
        x = self.embed[tokens]
        for i, p in enumerate(self.layers):
            q, k, v = self._qkv(x, p, positions)
            if attn.requires_kv_write:
                kv.write_kv(k, v, layer_idx=i, label=label)
            o = attn.run(q, label, kv.layer_view(i), k=k, v=v, layer_idx=i)
            x = self._mlp(self._attn_out(x, o, p), p)
        return _rms(x, self.norm) @ self.head

    def step_forward(self, kv: KVManager, attn: AttentionManager, label: str = "text",
                     options: CompileOptions | None = None) -> CompiledForward:
        """:meth:`forward_step` as a runner's forward in its two parts: the positions read from the
        step's KV plan (host), then the layers over tensors alone (what ``torch.compile`` traces).
        Called as is, it is the uncompiled forward."""

        def inputs(ctx: StepContext, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return tokens, ctx.plan_results[kv.name].layout(label).positions

        def body(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.forward_step(tokens, positions, kv, attn, label)

        return CompiledForward(inputs, body, options or CompileOptions(), "the tiny decoder")

    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` of one whole sequence, causal, no cache (sharded: every rank
        calls it)."""
        c = self.cfg
        n = len(tokens)
        positions = torch.arange(n, device=self.device)
        x = self.embed[tokens]
        g = c.num_qo_heads // c.num_kv_heads
        for p in self.layers:
            q, k, v = self._qkv(x, p, positions)
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = self._mlp(self._attn_out(x, o.transpose(0, 1), p), p)
        return _rms(x, self.norm) @ self.head
