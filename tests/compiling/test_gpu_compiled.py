"""On the GPU with FlashInfer: the custom ops pass ``opcheck`` over real wrappers, the tiny
decoder's compiled steps (Inductor, captured in CUDA graphs, pre-planned) match the no-cache
forward and the uncompiled runner, and a transformers Llama served compiled agrees with itself
served uncompiled."""

from __future__ import annotations

import importlib.util

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
    StepContext,
    select_backend,
)
from mstar_core.capabilities import PAGED
from mstar_core.compiling import CompileOptions
from mstar_core.demo import TinyDecoder, TinyDecoderConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")]
DEV, DT = torch.device("cuda"), torch.bfloat16


def _wrappers(head_dim=128):
    return select_backend(capabilities=PAGED, requested="flashinfer", device=DEV, dtype=DT, head_dim=head_dim).classes


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_ops_pass_opcheck_over_flashinfer():
    cfg = KVConfig(2, 2, 128, 16, 32, 8)
    kv = KVManager(cfg, DEV, DT)
    attn = PagedAttentionManager(kv, DEV, DT, cfg, _wrappers())
    node = Node([kv, attn])
    for r in ("a", "b"):
        node.ingest_request(r)
    st = Step(KVStep((KVSpan("a", "text", 20), KVSpan("b", "text", 7))))
    ctx = StepContext()
    assert node.admit(st, ctx)
    node.plan(st, ctx)
    q = torch.randn(27, 8, 128, device=DEV, dtype=DT)
    k, v = (torch.randn(27, 2, 128, device=DEV, dtype=DT) for _ in range(2))
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mstar.write_kv.default, (k, v, kv.storage, kv.op_handle, 0, "text"),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.mstar.paged_run.default, (q, kv.layer_view(0), attn.op_handle, 0, "text", None),
                          test_utils=tests)


def _runner(compiled: bool):
    cfg = TinyDecoderConfig(num_layers=2, hidden=256, mlp=512, num_qo_heads=8, num_kv_heads=2, head_dim=128)
    model = TinyDecoder(cfg, DEV, DT, seed=1)
    kvc = KVConfig(2, 2, 128, 16, 128, 8)
    kv = KVManager(kvc, DEV, DT)
    attn = PagedAttentionManager(kv, DEV, DT, kvc, _wrappers(), accelerator_graph=True)
    node = Node([kv, attn])
    forward = model.step_forward(kv, attn, options=CompileOptions("inductor"))
    runner = GraphRunner(node, forward, buckets=[4, 8], device=DEV, compiled=forward if compiled else None)
    runner.warmup()
    return model, kv, node, runner


def _decode(model, node, runner, steps=6):
    g = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(0, 256, (n,), generator=g).tolist() for i, n in enumerate([3, 17, 40])}
    seqs = {r: list(p) for r, p in prompts.items()}
    for r in prompts:
        node.ingest_request(r)
    logits = runner.step(Step(KVStep(tuple(KVSpan(r, "text", len(p)) for r, p in prompts.items()))),
                         torch.tensor([t for p in prompts.values() for t in p], device=DEV))
    ends = torch.tensor([len(p) for p in prompts.values()], device=DEV).cumsum(0) - 1
    got = {r: [logits[i].clone()] for r, i in zip(prompts, ends.tolist(), strict=True)}
    nxt = logits[ends].argmax(-1)
    decode = Step(KVStep(tuple(KVSpan(r, "text", 1) for r in prompts)))
    prep = runner.prepare(decode)
    for _ in range(steps):
        assert prep.graph is not None
        for r, t in zip(prompts, nxt.tolist(), strict=True):
            seqs[r].append(t)
        out = runner.launch(prep, nxt)
        prep = runner.prepare(decode)  # pre-planned while the replay runs
        for i, r in enumerate(prompts):
            got[r].append(out[i].clone())
        nxt = out.argmax(-1)
    runner.discard(prep)
    return prompts, seqs, got


def test_compiled_graph_steps_match_the_no_cache_forward_and_the_uncompiled_runner():
    model, kv, node, runner = _runner(compiled=True)
    assert sorted(runner.compiler.seconds) == [4, 8] and not runner.compiler.failed
    with torch._dynamo.config.patch(error_on_recompile=True):
        prompts, seqs, got = _decode(model, node, runner)
    for r in prompts:
        want = model.forward_full(torch.tensor(seqs[r], device=DEV))[len(prompts[r]) - 1:]
        err = _rel(torch.stack(got[r]), want)
        assert err < 3e-2, (r, err)
    kv.post_warmup_validate()
    model2, _, node2, plain = _runner(compiled=False)
    _, seqs2, got2 = _decode(model2, node2, plain)
    same = sum(a == b for r in seqs for a, b in zip(seqs[r], seqs2[r], strict=True))
    assert same >= 0.9 * sum(len(s) for s in seqs.values()), (seqs, seqs2)


@pytest.mark.requires_transformers
def test_a_transformers_llama_served_compiled_agrees_with_uncompiled():
    from mstar_core.integrations.transformers import generate_report
    from mstar_core.testing.hf_models import build

    model = build("llama", size="gpu", dtype=DT, device="cuda")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (5, 40, 17, 64)]
    plain = generate_report(model, prompts, 16, buckets=(4,))
    comp = generate_report(model, prompts, 16, buckets=(4,), compile=True)
    assert comp.compiled is not None and comp.compiled.startswith("compiled (inductor) for buckets [4]")
    same = sum(a == b for x, y in zip(plain.ids, comp.ids, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.75 * 64, (plain.ids, comp.ids)
