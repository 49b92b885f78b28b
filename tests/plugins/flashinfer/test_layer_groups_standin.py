"""Layer groups over FlashInfer's own declarations (the stand-in, registered as a CPU backend):
layers whose sink logits FlashInfer cannot combine with the model's soft-cap go to the reference,
the others stay on FlashInfer, and every step's outputs equal the single reference manager's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    GroupedPagedAttentionManager,
    PagedAttentionManager,
    Registry,
    build_paged_attention,
)
from mstar_core.backends import reference as R
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.registry import HeadDims
from mstar_flashinfer.plugin import FLASHINFER

from ...helpers import Harness

pytestmark = pytest.mark.usefixtures("standin_flashinfer")

FEATURES = AttentionFeatures(soft_cap=5.0, sink_logits=(True, False))
STEPS = [[("a", 20, True), ("b", 9, True)], [("a", 1, True), ("b", 1, True)],
         [("a", 1, True), ("b", 7, True), ("c", 5, True)], [("a", 1, True), ("b", 1, True), ("c", 1, True)]]


@pytest.fixture
def cpu_flashinfer(monkeypatch):
    spec = dataclasses.replace(FLASHINFER, devices=("cpu",), dtypes=(torch.float32,), head_dims=HeadDims(),
                               min_compute_capability=None, probe=None, warmup=None, measured=None)
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0")
    reg.register(spec, distribution="mstar-flashinfer", version="0")
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)
    monkeypatch.delenv("MSTAR_ATTENTION_BACKEND", raising=False)


def _run(make):
    h = Harness(make, torch.float32, layers=2, hq=4, d=32, page_size=8, seed=11, features=FEATURES)
    h.ingest("a", "b", "c")
    outs, errs = [], []
    for spans in STEPS:
        err, o = h.step(spans, causal=True)
        errs.append(err)
        outs += o
    return h, outs, max(errs)


def test_the_group_flashinfer_cannot_serve_goes_to_the_reference_and_outputs_match(cpu_flashinfer):
    built = {}

    def grouped(kv, cfg):
        built["attn"] = build_paged_attention(kv, "cpu", kv.dtype, cfg, None, features=FEATURES)
        return built["attn"]

    h, outs, err = _run(grouped)
    attn = built["attn"]
    assert isinstance(attn, GroupedPagedAttentionManager)
    picks = {g.layers: m.backend_names for g, m in zip(attn.groups, attn.managers, strict=True)}
    assert set(picks[(0,)].values()) == {"reference"}  # sink logits with soft-cap: excluded on FlashInfer
    assert set(picks[(1,)].values()) == {"flashinfer"}
    assert err < 1e-4

    def single(kv, cfg):
        wrappers = {"paged_prefill": R.ReferencePrefillWrapper, "paged_decode": R.ReferenceDecodeWrapper,
                    "mixed": R.ReferenceMixedWrapper}
        return PagedAttentionManager(kv, "cpu", kv.dtype, cfg, wrappers, features=FEATURES)

    _, want, _ = _run(single)
    assert len(outs) == len(want)
    for a, b in zip(outs, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
