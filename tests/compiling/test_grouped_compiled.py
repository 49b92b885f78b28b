"""A grouped paged manager under torch.compile: each layer's op names its group's manager, so
the compiled graph steps give the eager single manager's logits without recompiling."""

from __future__ import annotations

import torch

from mstar_core import AttentionFeatures, GroupedPagedAttentionManager, KVConfig, KVManager, Node, build_paged_attention
from mstar_core.compiling import CompiledForward, CompileOptions
from mstar_core.demo import TinyDecoder, TinyDecoderConfig
from mstar_core.graphs import GraphRunner

from ..group_fakes import RUNS, install_group_backend
from ..helpers import step

FEATURES = AttentionFeatures(layer_windows=(3, -1))


def _logits(backend, compiled):
    cfg = TinyDecoderConfig(num_layers=2, hidden=32, mlp=64, num_qo_heads=4, num_kv_heads=2, head_dim=8)
    model = TinyDecoder(cfg, "cpu", torch.float32, seed=5)
    kvc = KVConfig(2, 2, 8, 4, 32, 4)
    kv = KVManager(kvc, "cpu", torch.float32, features=FEATURES)
    attn = build_paged_attention(kv, "cpu", torch.float32, kvc, backend, accelerator_graph=True)
    node = Node([kv, attn])
    parts = model.step_forward(kv, attn)
    runner = GraphRunner(node, parts, [2], "cpu", compiled=CompiledForward(
        parts.inputs, parts.body, CompileOptions("aot_eager"), "tiny") if compiled else None)
    runner.warmup()
    for r in ("a", "b"):
        node.ingest_request(r)
    out = runner.step(step(("a", "text", 4), ("b", "text", 2)), torch.tensor([1, 2, 3, 4, 5, 6]))
    nxt, logits = out[[3, 5]].argmax(-1), []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            prep = runner.prepare(step(("a", "text", 1), ("b", "text", 1)))
            assert prep.graph is not None
            out = runner.launch(prep, nxt)
            logits.append(out.clone())
            nxt = out.argmax(-1)
    return attn, torch.stack(logits)


def test_compiled_graph_steps_of_a_grouped_manager_give_the_eager_single_manager_s_logits(fake_module, monkeypatch):
    install_group_backend(fake_module, monkeypatch)
    grouped, got = _logits(None, compiled=True)
    assert isinstance(grouped, GroupedPagedAttentionManager) and RUNS.get("paged_decode", 0) > 0
    _, want = _logits("reference", compiled=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
