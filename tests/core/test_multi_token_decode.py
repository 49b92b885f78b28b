"""Uniform multi-token decode rows (speculative verification, issue 13): every row 2..8 query
tokens, captured and replayed like one-token decode, pre-planned, against the no-cache forward."""

import pytest
import torch

from mstar_core import KVSpan, KVStep, Step
from mstar_core.features import AttentionFeatures
from mstar_core.graphs import GraphRunner
from mstar_core.demo import TinyDecoder, TinyDecoderConfig
from mstar_core.attention.paged import PagedAttentionManager
from mstar_core.kv import KVConfig, KVManager
from mstar_core.node import Node
from mstar_core.testing.oracle import rel_error

from .helpers import REF_WRAPPERS


def build(query_tokens=4, features=None, wrappers=REF_WRAPPERS, layers=2, head_dim=16, dtype=torch.float64,
          device="cpu"):
    cfg = TinyDecoderConfig(num_layers=layers, hidden=64, mlp=128, num_qo_heads=4, num_kv_heads=2, head_dim=head_dim)
    model = TinyDecoder(cfg, device, dtype, seed=5)
    features = features or AttentionFeatures(decode_query_tokens=query_tokens)
    kvc = KVConfig(layers, 2, head_dim, 16 if device == "cuda" else 4, 64, 4)
    kv = KVManager(kvc, device, dtype, features=features)
    attn = PagedAttentionManager(kv, device, dtype, kvc, wrappers, accelerator_graph=True)
    node = Node([kv, attn])

    def forward(ctx, tokens):
        pos = ctx.plan_results["kv"].layout("text").positions
        return model.forward_step(tokens, pos, kv, attn, "text")

    runner = GraphRunner(node, forward, buckets=[2, 4], device=device, query_tokens=query_tokens)
    return model, kv, attn, node, runner


def verify(model, node, runner, t, steps=4, atol=1e-9):
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


@pytest.mark.parametrize("t", [2, 4, 8])
def test_multi_token_decode_replays_and_matches_the_full_forward(t):
    model, kv, _, node, runner = build(t)
    runner.warmup()
    assert runner.enabled and kv._graph_bufs.shape[2] == 4 * t  # per-token buffers for bucket x tokens
    verify(model, node, runner, t)


def test_rows_of_another_length_run_eagerly():
    _, _, _, node, runner = build(4)
    runner.warmup()
    for r in "ab":
        node.ingest_request(r)
    runner.step(Step(KVStep((KVSpan("a", "text", 3), KVSpan("b", "text", 3)))), torch.arange(6))
    prep = runner.prepare(Step(KVStep((KVSpan("a", "text", 2), KVSpan("b", "text", 4)))))
    assert prep.graph is None  # not uniform 4: eager
    runner.discard(prep)
    prep = runner.prepare(Step(KVStep((KVSpan("a", "text", 4), KVSpan("b", "text", 4)))))
    assert prep.graph is not None and prep.ctx.bucket == 2
    runner.discard(prep)


def test_graph_steps_beyond_the_features_query_tokens_are_refused():
    _, _, _, node, runner = build(4, features=AttentionFeatures(decode_query_tokens=2))
    with pytest.raises(ValueError, match=r"4 query tokens per row; the features allow decode_query_tokens=2"):
        runner.warmup()
    with pytest.raises(ValueError, match=r"query_tokens must be an int in 1..8"):
        GraphRunner(node, lambda ctx, t: t, [2], "cpu", query_tokens=9)
