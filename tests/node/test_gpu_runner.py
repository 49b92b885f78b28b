"""On the GPU: the runner with real CUDA graphs (FlashInfer decode wrappers in graph mode),
fresh plans between replays and pre-planning, against the no-cache forward; and the demo."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from mstar_core import (
    GraphRunner,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
    select_backend,
)
from mstar_core.capabilities import PAGED
from mstar_core.demo import TinyDecoder, TinyDecoderConfig

pytestmark = pytest.mark.gpu
needs_fi = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_fi
@pytest.mark.parametrize("preplan", [False, True], ids=["plain", "preplan"])
def test_graph_decode_matches_no_cache_forward(preplan):
    dev, dt = torch.device("cuda"), torch.bfloat16
    cfg = TinyDecoderConfig(num_layers=2, hidden=256, mlp=512, num_qo_heads=8, num_kv_heads=2, head_dim=128)
    model = TinyDecoder(cfg, dev, dt, seed=1)
    sel = select_backend(capabilities=PAGED, requested="flashinfer", device=dev, dtype=dt, head_dim=128)
    kvc = KVConfig(2, 2, 128, 16, 128, 8)
    kv = KVManager(kvc, dev, dt)
    attn = PagedAttentionManager(kv, dev, dt, kvc, sel.classes, accelerator_graph=True)
    node = Node([kv, attn])

    def forward(ctx, tokens):
        return model.forward_step(tokens, ctx.plan_results["kv"].layout("text").positions, kv, attn, "text")

    runner = GraphRunner(node, forward, buckets=[4, 8], device=dev)
    runner.warmup()
    assert runner.enabled
    g = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(0, 256, (n,), generator=g).tolist() for i, n in enumerate([3, 17, 40])}
    seqs = {r: list(p) for r, p in prompts.items()}
    for r in prompts:
        node.ingest_request(r)
    pre = Step(KVStep(tuple(KVSpan(r, "text", len(p)) for r, p in prompts.items())))
    logits = runner.step(pre, torch.tensor([t for p in prompts.values() for t in p], device=dev))
    ends = torch.tensor([len(p) for p in prompts.values()], device=dev).cumsum(0) - 1
    got = {r: [logits[i].clone()] for r, i in zip(prompts, ends.tolist(), strict=True)}
    nxt = logits[ends].argmax(-1)
    decode = Step(KVStep(tuple(KVSpan(r, "text", 1) for r in prompts)))
    prep = runner.prepare(decode)
    for _ in range(6):
        assert prep.graph is not None  # replayed from the captured graph (bucket 4)
        for r, t in zip(prompts, nxt.tolist(), strict=True):
            seqs[r].append(t)
        out = runner.launch(prep, nxt)
        if preplan:
            prep = runner.prepare(decode)  # planned while the replay runs
        for i, r in enumerate(prompts):
            got[r].append(out[i].clone())
        nxt = out.argmax(-1)
        if not preplan:
            prep = runner.prepare(decode)
    runner.discard(prep)
    for r in prompts:
        want = model.forward_full(torch.tensor(seqs[r], device=dev))[len(prompts[r]) - 1:]
        err = _rel(torch.stack(got[r]), want)
        assert err < 3e-2, (r, err)
    kv.post_warmup_validate()


@needs_fi
def test_demo_on_gpu_with_flashinfer():
    r = subprocess.run([sys.executable, "-m", "mstar_core.cli", "demo", "--device", "cuda", "--backend", "flashinfer"],
                       capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and "backend: flashinfer" in r.stdout
