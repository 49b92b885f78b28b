"""transformers models through mstar (reference backend, float32, CPU): every architecture's
greedy ids equal ``model.generate(do_sample=False)`` with eager attention, prompt by prompt, with
requests of different lengths arriving at different steps; and what mstar cannot serve is
refused when the model is switched, leaving the model as it was."""

from __future__ import annotations

import functools

import pytest
import torch

from mstar_core import (
    Engine,
    EngineOptions,
    UnsupportedModel,
    generate,
    generate_report,
    probe,
)
from mstar_core.integrations.transformers import run
from mstar_core.integrations.transformers.engine import release, switch
from mstar_core.testing.hf_models import ARCHITECTURES, build

from ...helpers import REPO, hf_greedy

NEW = 32
# 1 token, a page boundary (16) and one past it, several pages; arriving over the first steps.
LENGTHS = (1, 16, 17, 40, 5, 33, 48)
ARRIVALS = (0, 0, 1, 3, 5, 9, 9)


def prompts(vocab: int, lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def case(arch: str):
    """A model of ``arch``, the prompts, and transformers' greedy ids for each (built once)."""
    model = build(arch)
    ps = prompts(model.config.vocab_size)
    return model, ps, [hf_greedy(model, p, NEW) for p in ps]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_ids_equal_transformers_generate(arch):
    model, ps, want = case(arch)
    rep = generate_report(model, ps, NEW, backend="reference", arrivals=list(ARRIVALS))
    for i, (got, ref) in enumerate(zip(rep.ids, want, strict=True)):
        assert got == ref, f"{arch}: prompt {i} ({len(ps[i])} tokens) differs from transformers' generate"
    assert all(len(x) == NEW for x in rep.ids)
    kinds = rep.kinds
    assert kinds["mixed"] >= 1 and kinds["decode"] >= 1, kinds  # requests joined running ones
    assert model.config._attn_implementation == "eager"  # switched back


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_graph_replay_and_waiting_admissions(arch):
    """Decode steps through the graph runner (on a CPU a replay re-runs the captured closure
    over the same static buffers) and a cache too small for every request at once: admissions
    wait for pages, the ids do not change."""
    model, ps, want = case(arch)
    rep = generate_report(model, ps, NEW, backend="reference", arrivals=list(ARRIVALS), graphs=True,
                          max_pages=12, buckets=(1, 2, 4, 8))
    assert rep.ids == want
    assert rep.waits > 0
    assert sum(1 for s in rep.steps if s.graph) > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_probe_reads_each_layers_attention(arch):
    model = case(arch)[0]
    switch(model)
    try:
        a = probe(model)
    finally:
        release(model)
    f = a.features()
    cfg = model.config
    assert (a.qo_heads, a.kv_heads, a.head_dim) == (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    if arch == "gemma2":
        assert f.soft_cap == 5.0 and f.layer_windows == (19, -1, 19, -1) and a.sm_scale == 64 ** -0.5
    elif arch == "gpt_oss":
        assert f.sink_logits and f.layer_windows == (19, -1, 19, -1)
    elif arch == "mistral":
        assert f.layer_windows == (23,) * 4 and f.requested() == ()  # one window for all: plain attention
    else:
        assert f.requested() == () and f.layer_windows is None


def test_end_of_sequence_stops_like_transformers():
    model = build("llama")
    p = prompts(model.config.vocab_size, (7, 20))
    free = hf_greedy(model, p[0], NEW)
    eos = free[5]  # a token greedy decoding reaches: generation stops at its first occurrence
    want = [hf_greedy(model, x, NEW, eos_token_id=eos) for x in p]
    got = generate(model, p, NEW, backend="reference", eos_token_id=eos)
    assert got == want
    assert got[0][-1] == eos and len(got[0]) == free.index(eos) + 1


def test_failure_mid_run_frees_every_page_and_restores_the_model():
    model = build("qwen3")
    ps = prompts(model.config.vocab_size, (3, 18, 9))
    calls = []

    def boom(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a user's ^C looks like to the loop

    with Engine(model, "reference", EngineOptions(max_pages=16)) as engine:
        with pytest.raises(KeyboardInterrupt):
            run(engine, ps, NEW, on_step=boom)
        assert engine.kv.num_free_pages == 16 and engine.kv.requests == ()
        # The same engine serves the next run, and correctly.
        assert run(engine, ps[:1], 8).ids[0] == hf_greedy(model, ps[0], 8)
    assert model.config._attn_implementation == "eager"


def test_outside_mstars_runner_the_attention_says_how_to_run():
    model = build("llama")
    switch(model)
    try:
        with pytest.raises(RuntimeError, match="integrations.transformers.generate"):
            model(torch.tensor([[1, 2, 3]]))
    finally:
        release(model)
    assert model.config._attn_implementation == "eager"


def test_cross_attention_model_is_refused_and_left_unchanged():
    import transformers

    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModel, match="cross-attention"):
        generate(model, [[1, 2]], 4)
    assert model.config._attn_implementation == before


def test_latent_attention_mla_is_refused_naming_it():
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModel, match="MLA"):
        generate(model, [[1, 2]], 4)
    assert model.config._attn_implementation == "eager"


def test_a_feature_the_named_backend_lacks_is_refused_naming_it_and_who_can():
    model = build("gemma2")
    with pytest.raises(ValueError, match=r"does not support feature soft_cap.*Backends that can: reference"):
        generate(model, [[1, 2]], 4, backend="fa3")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[], max_new_tokens=4), "non-empty list"),
    (dict(prompts=[[1, 2], []], max_new_tokens=4), r"prompts\[1\]"),
    (dict(prompts=[[1, 999]], max_new_tokens=4), "outside the vocabulary"),
    (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1, 2]], max_new_tokens=4, arrivals=[0, 1]), "arrivals"),
    (dict(prompts=[[1] * 40], max_new_tokens=4, max_pages=2), "raise max_pages"),
])
def test_bad_input_is_refused_naming_it(kwargs, match):
    model = build("llama")
    with pytest.raises(ValueError, match=match):
        generate(model, backend="reference", **kwargs)
    assert model.config._attn_implementation == "eager"


def test_unknown_option_names_the_accepted_ones():
    with pytest.raises(TypeError, match="max_pages"):
        generate(build("llama"), [[1]], 2, max_page=3)


@pytest.mark.slow
def test_the_core_never_imports_transformers():
    """Only the integration imports it: the CLI, the registry and every backend load without."""
    import subprocess
    import sys

    code = ("import sys, mstar_core, mstar_core.cli, mstar_core.registry, mstar_core.testing.hf_models; "
            "from mstar_core.registry import get_registry; get_registry(); "
            "from mstar_core.cli import build_parser; build_parser(); "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_forward_that_cannot_be_captured_runs_eagerly_unless_graphs_were_asked_for(monkeypatch, caplog):
    """A capture failure (on CUDA: a host sync in the model's forward) turns graphs off with a
    warning when graphs were only the default; the ids stay right. Asked for, it is an error."""
    import mstar_core.graphs as graphs_mod

    def fail(fn, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_mod, "capture_graph", fail)
    model, ps, want = case("llama")
    import mstar_core.integrations.transformers.engine as engine_mod

    monkeypatch.setattr(engine_mod, "graphs_default", lambda device: True)  # as on CUDA
    with caplog.at_level("WARNING"), Engine(model, "reference", EngineOptions(max_pages=65)) as engine:
        assert not engine.runner.enabled
        assert run(engine, ps[:2], NEW).ids == want[:2]
    assert "graphs off: capturing LlamaForCausalLM" in caplog.text
    with pytest.raises(RuntimeError, match="stream is capturing"):
        Engine(model, "reference", EngineOptions(max_pages=65, graphs=True))
    assert model.config._attn_implementation == "eager"


def test_the_readme_example_runs_as_written():
    """The README's "Use with transformers" example, executed: its assert compares with
    transformers' own greedy ids."""
    import re

    text = (REPO / "README.md").read_text()
    section = text.split("## Use with transformers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert "generate(model" in code and "assert ids[0] == ref" in code
    exec(compile(code, "README.md", "exec"), {})


@pytest.mark.slow
def test_fp8_kv_cache_option():
    """kv_dtype="fp8_e4m3" stores the cache in FP8 (scale 1.0). Gemma 2's capped logits keep
    every greedy token through FP8's rounding here (Llama's random ones do not: FP8 is lossy);
    broken scaling or a cache read back in the wrong dtype would not."""
    model, ps, want = case("gemma2")
    with Engine(model, "reference", EngineOptions(max_pages=64, kv_dtype="fp8_e4m3")) as engine:
        assert engine.kv.kv_dtype == torch.float8_e4m3fn
        assert run(engine, ps, NEW, arrivals=list(ARRIVALS)).ids == want
