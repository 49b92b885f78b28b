"""transformers models through mstar's FA3 paged wrappers (the stand-in, registered as a CPU
backend) in bfloat16: the greedy ids equal the reference backend's in the same dtype, with
windows and sink logits (gpt-oss) and without (Llama), every paged capability from FA3 or only
decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mstar_core import Registry
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.testing.hf_models import build
from mstar_fa3.plugin import FA3

pytestmark = [pytest.mark.usefixtures("fa3_standin"), pytest.mark.requires_transformers]


@pytest.fixture
def cpu_fa3(monkeypatch):
    """FA3 as this process's registry sees it, runnable on the CPU over the stand-in."""
    spec = dataclasses.replace(FA3, devices=("cpu",), archs=None, probe=None, measured=None)
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0")
    reg.register(spec, distribution="mstar-fa3", version="0")
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)
    monkeypatch.delenv("MSTAR_ATTENTION_BACKEND", raising=False)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
@pytest.mark.parametrize("backend", ["fa3", {"paged_decode": "fa3", "default": "reference"}], ids=["all", "decode"])
def test_greedy_ids_equal_the_reference_backends(cpu_fa3, arch, backend):
    from mstar_core import generate_report

    model = build(arch, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23, 12)]
    want = generate_report(model, prompts, 10, arrivals=[0, 0, 2], backend="reference")
    got = generate_report(model, prompts, 10, arrivals=[0, 0, 2], backend=backend)
    assert got.ids == want.ids
    assert "fa3" in got.backend and got.kinds["decode"] > 0
