"""The runner's compiled graph steps, with the tiny decoder through the reference backend on CPU:
one compile per bucket at warm-up (announced and timed), the same logits as the no-cache forward,
no recompile from one step to the next, and a model that cannot be compiled running uncompiled
with a warning (or failing, where compiling was required)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from mstar_core import KVSpan, KVStep, Step
from mstar_core.compiling import CompiledForward, CompileError, CompileOptions, compile_options
from mstar_core.errors import InputError, InputTypeError
from mstar_core.graphs import GraphRunner

from ..helpers import tiny_graph_node


def compiled_runner(options=None, body_hook=None):
    options = options or CompileOptions("aot_eager")
    model, kv, attn, node, plain = tiny_graph_node(buckets=(2, 4))
    parts = model.step_forward(kv, attn)

    def body(tokens, positions):
        if body_hook is not None:
            body_hook()
        return parts.body(tokens, positions)

    runner = GraphRunner(node, plain.forward, [2, 4], "cpu",
                         compiled=CompiledForward(parts.inputs, body, options, "tiny"))
    return model, kv, node, runner


def test_compiled_graph_steps_match_the_no_cache_forward_without_recompiling(caplog):
    model, kv, node, runner = compiled_runner()
    with caplog.at_level(logging.INFO):
        runner.warmup()
    assert sorted(runner.compiler.seconds) == [2, 4] and not runner.compiler.failed
    said = [r.getMessage() for r in caplog.records]
    assert any("torch.compile (aot_eager) of tiny's decode step for 4 rows: first use" in m for m in said), said
    assert any("compiled (aot_eager) for buckets [2, 4]" in m for m in said), said
    prompts = {"a": [1, 2, 3, 4, 5], "b": [7, 8], "c": [9, 10, 11]}
    seqs = {r: list(p) for r, p in prompts.items()}
    for r in prompts:
        node.ingest_request(r)
    logits = runner.step(Step(KVStep(tuple(KVSpan(r, "text", len(p)) for r, p in prompts.items()))),
                         torch.tensor([t for p in prompts.values() for t in p]))
    ends = torch.tensor([len(p) for p in prompts.values()]).cumsum(0) - 1
    got = {r: [logits[i]] for r, i in zip(prompts, ends, strict=True)}
    nxt = logits[ends].argmax(-1)
    decode = Step(KVStep(tuple(KVSpan(r, "text", 1) for r in prompts)))
    with torch._dynamo.config.patch(error_on_recompile=True):  # compiled at warm-up: never again
        prep = runner.prepare(decode)
        for _ in range(5):
            assert prep.graph is not None and prep.ctx.bucket == 4
            for r, t in zip(prompts, nxt.tolist(), strict=True):
                seqs[r].append(t)
            out = runner.launch(prep, nxt)
            prep = runner.prepare(decode)
            for i, r in enumerate(prompts):
                got[r].append(out[i].clone())
            nxt = out.argmax(-1)
        runner.discard(prep)
    for r in prompts:
        want = model.forward_full(torch.tensor(seqs[r]))[len(prompts[r]) - 1:]
        torch.testing.assert_close(torch.stack(got[r]), want, atol=1e-9, rtol=0)


def _untraceable():
    torch._dynamo.graph_break()


def test_a_body_that_cannot_be_compiled_fails_where_compile_was_required():
    _, kv, _, runner = compiled_runner(CompileOptions("aot_eager", required=True), body_hook=_untraceable)
    free = kv.num_free_pages
    with pytest.raises(CompileError, match="decode step for 2 rows failed"):
        runner.warmup()
    # nothing half-captured: the dummies' pages are back (the padding rows' sink page stays, as after any warm-up)
    assert not runner.enabled and not runner._graphs and kv.num_free_pages == free - 1


def test_a_body_that_cannot_be_compiled_runs_uncompiled_with_a_warning(caplog):
    model, _, node, runner = compiled_runner(CompileOptions("aot_eager", required=False), body_hook=_untraceable)
    with caplog.at_level(logging.WARNING):
        runner.warmup()
    assert runner.enabled and sorted(runner.compiler.failed) == [2, 4] and not runner.compiler.seconds
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # said once, with the reason: the later bucket is not compiled again
    assert warned == ["torch.compile (aot_eager) of tiny's decode step for 2 rows failed, so its steps run uncompiled: "
                      "Unsupported: Call to `torch._dynamo.graph_break()`"], warned
    node.ingest_request("a")
    runner.step(Step(KVStep((KVSpan("a", "text", 3),))), torch.tensor([1, 2, 3]))
    out = runner.step(Step(KVStep((KVSpan("a", "text", 1),))), torch.tensor([4]))
    want = model.forward_full(torch.tensor([1, 2, 3, 4]))[-1]
    torch.testing.assert_close(out[0], want, atol=1e-9, rtol=0)


def test_compile_options_are_checked_where_they_are_given():
    with pytest.raises(InputError, match="no backend 'inductr'"):
        CompileOptions("inductr")
    with pytest.raises(InputTypeError, match="compile must be True, False or None"):
        compile_options("yes")
    assert compile_options(False) is None and compile_options(None).required is False
    with pytest.raises(InputTypeError, match="compiled must be a CompiledForward"):
        GraphRunner(tiny_graph_node()[3], lambda c, t: t, [2], "cpu", compiled=lambda t: t)


@pytest.mark.slow  # inductor compiles the decoder: seconds even from a warm cache
def test_bench_compiles_the_tiny_decoder_and_says_so():
    cmd = [sys.executable, "-m", "mstar_core.cli", "bench", "--graphs", "--compile", "--compile-backend", "aot_eager",
           "--steps", "2", "--warmup", "1", "--batch", "2", "--context", "8", "--layers", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    # (the progress line on stderr shows only for a compile over a second: cached, this one may not)
    assert "compiled at warm-up in" in p.stdout
    p = subprocess.run(cmd[:4] + cmd[5:], capture_output=True, text=True, timeout=300)  # --compile without --graphs
    assert p.returncode != 0 and "use it with graphs" in p.stderr
