"""transformers models served compiled (``compile=True``): on CPU through the reference backend,
a tiny Llama with Inductor (a C++ compiler is on CI's machine) and a tiny Qwen3 and Gemma 2 with
``aot_eager`` (no code generation: the same trace, quicker): greedy ids identical to the
uncompiled run and to transformers' own ``generate``, a trace with no graph break, and a model
that cannot be compiled running uncompiled with a warning, or failing where compile was asked for."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mstar_core import Engine, EngineOptions
from mstar_core.cli import main
from mstar_core.compiling import CompileError
from mstar_core.errors import InputError
from mstar_core.integrations.transformers import generate, generate_report
from mstar_core.integrations.transformers.engine import LABEL
from mstar_core.step import KVSpan, KVStep, Step
from mstar_core.testing.hf_models import build

from ...helpers import hf_greedy

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [3]]


@pytest.mark.parametrize(("arch", "backend"), [
    pytest.param("llama", "inductor", marks=pytest.mark.slow),  # inductor's C++ build: half a minute from a cold cache
    ("qwen3", "aot_eager"), ("gemma2", "aot_eager")])
def test_compiled_greedy_ids_equal_uncompiled_and_transformers(arch, backend):
    model = build(arch)
    plain = generate(model, PROMPTS, 10, graphs=True, buckets=(4,))
    rep = generate_report(model, PROMPTS, 10, buckets=(4,), compile=True, compile_backend=backend)
    assert rep.ids == plain == [hf_greedy(model, p, 10) for p in PROMPTS]
    assert sum(1 for s in rep.steps if s.graph) >= 8  # the decode steps ran the compiled graph
    assert rep.compiled is not None and rep.compiled.startswith(f"compiled ({backend}) for buckets [4]")
    assert any(line.startswith("graph steps compiled") for line in rep.lines())


def test_the_compiled_step_traces_with_no_graph_break():
    model = build("llama")
    with Engine(model, None, EngineOptions(max_pages=32, buckets=(2,), graphs=True)) as e:
        for r in ("a", "b"):
            e.node.ingest_request(r)
        e.runner.step(Step(KVStep((KVSpan("a", LABEL, 3), KVSpan("b", LABEL, 2))), e.step_attn),
                      torch.tensor([1, 2, 3, 4, 5]))
        prep = e.runner.prepare(Step(KVStep((KVSpan("a", LABEL, 1), KVSpan("b", LABEL, 1))), e.step_attn))
        assert prep.graph is not None
        with torch.no_grad(), e.node.bound(prep.ctx):
            explain = torch._dynamo.explain(e._body)(*e._graph_inputs(prep.ctx, torch.tensor([6, 7])))
        e.runner.discard(prep)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    ops = [str(n.target) for g in explain.graphs for n in g.graph.nodes if "mstar" in str(n.target)]
    assert ops.count("mstar.write_kv.default") == ops.count("mstar.paged_run.default") == 4  # one each per layer


def _untraceable_mlp(model):
    """Layer 0's MLP calls something Dynamo cannot trace in one graph."""
    mlp = model.model.layers[0].mlp
    forward = mlp.forward

    def patched(x):
        torch._dynamo.graph_break()
        return forward(x)

    mlp.forward = patched


def test_a_model_that_cannot_be_compiled_runs_uncompiled_with_a_warning_or_fails(caplog):
    model = build("llama")
    _untraceable_mlp(model)
    want = generate(model, PROMPTS, 6, graphs=True, buckets=(4,))
    with caplog.at_level(logging.WARNING):
        rep = generate_report(model, PROMPTS, 6, buckets=(4,), compile=None, compile_backend="aot_eager")
    assert rep.ids == want
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("LlamaForCausalLM's decode step for 4 rows failed, so its steps run uncompiled" in m
               and "graph_break" in m for m in warned), warned
    with pytest.raises(CompileError, match="pass compile=None to run such a model uncompiled"):
        generate(model, PROMPTS, 6, buckets=(4,), compile=True, compile_backend="aot_eager")
    assert model.config._attn_implementation == "eager"  # the failed engine gave the model back


def test_compile_options_are_refused_before_anything_is_built():
    model = build("llama")
    with pytest.raises(InputError, match="compile compiles the graph steps"):
        generate(model, PROMPTS, 4, compile=True, graphs=False)
    with pytest.raises(InputError, match="no backend 'fast'"):
        generate(model, PROMPTS, 4, compile=True, compile_backend="fast")


def test_mstar_generate_compile(tmp_path, capsys):
    model = build("qwen3", seed=2)
    model.save_pretrained(tmp_path)
    argv = ["generate", str(tmp_path), "--prompt", "1,2,3", "--prompt", "4,5", "--ids", "--max-new-tokens", "6",
            "--compile", "--compile-backend", "aot_eager"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ids"] == [hf_greedy(model, [1, 2, 3], 6), hf_greedy(model, [4, 5], 6)]
    assert out["compiled"].startswith("compiled (aot_eager) for buckets")


def test_compile_where_the_backend_cannot_capture_fails_or_warns(monkeypatch, caplog):
    from mstar_core.attention.paged import PagedAttentionManager

    model = build("llama")
    monkeypatch.setattr(PagedAttentionManager, "can_capture", lambda self: False)
    with pytest.raises(CompileError, match="cannot capture paged decode here, and only graph steps are compiled"):
        generate(model, PROMPTS, 4, buckets=(4,), compile=True, compile_backend="aot_eager")
    with caplog.at_level(logging.WARNING):
        ids = generate(model, PROMPTS, 4, buckets=(4,), compile=None, compile_backend="aot_eager")
    assert ids == [hf_greedy(model, p, 4) for p in PROMPTS]
    assert any("steps run eagerly, uncompiled" in r.getMessage() for r in caplog.records)
