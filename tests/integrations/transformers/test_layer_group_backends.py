"""A transformers model whose layers ask different things: each layer group takes its own
backend under ``auto`` (the layers without sink logits a third-party one, the others the
reference), and the greedy ids are those of the reference serving every layer."""

from __future__ import annotations

import torch

from mstar_core import Engine, EngineOptions, GroupedPagedAttentionManager, PagedAttentionManager, generate_report
from mstar_core.testing.hf_models import build

from ...group_fakes import FAKE, RUNS, install_group_backend


def _gpt_oss_with_sinks_on_windowed_layers_only():
    model = build("gpt_oss")
    for layer in model.model.layers[1::2]:  # the full-attention layers: no sink logits
        layer.self_attn.sinks = None
    return model


def test_groups_split_across_backends_and_the_ids_are_the_reference_s(fake_module, monkeypatch):
    install_group_backend(fake_module, monkeypatch)
    model = _gpt_oss_with_sinks_on_windowed_layers_only()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23, 11)]
    want = generate_report(model, prompts, 10, backend="reference")
    assert want.backend == "reference"
    got = generate_report(model, prompts, 10, arrivals=[0, 0, 2], graphs=True)
    assert got.ids == want.ids
    assert got.backend == f"reference+{FAKE}"
    assert RUNS.get("paged_decode", 0) > 0 and RUNS.get("paged_prefill", 0) > 0  # the fake served its layers


def test_the_engine_builds_one_manager_per_group_with_graphs(fake_module, monkeypatch):
    install_group_backend(fake_module, monkeypatch)
    model = _gpt_oss_with_sinks_on_windowed_layers_only()
    with Engine(model, options=EngineOptions(max_pages=64, max_batch_size=4, graphs=True)) as e:
        assert isinstance(e.attn, GroupedPagedAttentionManager) and e.runner.enabled
        assert [(g.layers, g.window, g.sink_logits) for g in e.attn.groups] == [((0, 2), 19, True),
                                                                                 ((1, 3), -1, False)]
        assert [m.backend_name for m in e.attn.managers] == ["reference", FAKE]
        assert e.backends == {c: f"reference+{FAKE}" for c in ("paged_prefill", "paged_decode", "mixed")}
    with Engine(build("llama"), options=EngineOptions(max_pages=64, max_batch_size=4)) as e:
        assert type(e.attn) is PagedAttentionManager and e.backend == FAKE  # one group: today's manager
