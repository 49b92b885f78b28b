"""A decode-only third-party backend under ``auto``: it serves every decode step of a
transformers model while the reference serves prefill and mixed steps, and the greedy ids are
transformers' own."""

from __future__ import annotations

import torch

from mstar_core import generate_report
from mstar_core.backends.reference import ReferenceDecodeWrapper
from mstar_core.testing.hf_models import build

from ...helpers import hf_greedy, install_decode_backend


class CountingDecode(ReferenceDecodeWrapper):
    """A decode kernel of a third-party distribution: counts its runs."""

    runs = 0

    def run(self, *args, **kw):
        CountingDecode.runs += 1
        return super().run(*args, **kw)


def _install(fake_module, monkeypatch) -> None:
    install_decode_backend(fake_module, monkeypatch, "fastdecode", CountingDecode)


def test_a_decode_only_backend_serves_decode_under_auto_with_the_same_ids(fake_module, monkeypatch):
    _install(fake_module, monkeypatch)
    model = build("llama")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 9)]
    want = [hf_greedy(model, p, 12) for p in prompts]
    CountingDecode.runs = 0
    rep = generate_report(model, prompts, 12, arrivals=[0, 0, 2])
    assert rep.ids == want
    assert rep.backend == "reference+fastdecode"
    layers = model.config.num_hidden_layers
    assert CountingDecode.runs == rep.kinds["decode"] * layers > 0  # every decode step's layers, nothing else
    assert rep.kinds["prefill"] >= 1 and rep.kinds["mixed"] >= 1  # the reference's steps


def test_a_capability_table_as_the_argument_or_in_config_decides_who_serves_decode(fake_module, monkeypatch):
    _install(fake_module, monkeypatch)
    model = build("llama")
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3]]
    want = [hf_greedy(model, p, 6) for p in prompts]
    CountingDecode.runs = 0
    rep = generate_report(model, prompts, 6, backend={"default": "reference"})  # every capability from it
    assert rep.ids == want and rep.backend == "reference" and CountingDecode.runs == 0
    table = {"paged_decode": "fastdecode", "default": "reference"}
    rep = generate_report(model, prompts, 6, config={"attention": {"backend": table}})
    assert rep.ids == want and rep.backend == "reference+fastdecode" and CountingDecode.runs > 0
    # the argument's table wins over config's
    CountingDecode.runs = 0
    rep = generate_report(model, prompts, 6, backend={"default": "reference"}, config={"attention": {"backend": table}})
    assert rep.backend == "reference" and CountingDecode.runs == 0
