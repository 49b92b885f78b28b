"""The paged attention manager over FA3's paged wrappers (the stand-in, bf16, CPU): prompts,
chunks, mixed and decode steps against the float64 truth of every stream, with a window per layer
and sink logits, as FA3 declares them."""

from __future__ import annotations

import pytest
import torch

from mstar_core import PagedAttentionManager
from mstar_core.features import AttentionFeatures
from mstar_fa3.paged import FA3DecodeWrapper, FA3MixedWrapper, FA3PrefillWrapper
from mstar_fa3.plugin import FA3

from ...helpers import Harness

pytestmark = pytest.mark.usefixtures("fa3_standin")

WRAPPERS = {"paged_prefill": FA3PrefillWrapper, "paged_decode": FA3DecodeWrapper, "mixed": FA3MixedWrapper}
STEPS = [
    [("a", 20, True), ("b", 33, True)],  # prompts
    [("a", 1, True), ("b", 1, True)],  # decode
    [("a", 1, True), ("b", 9, True), ("c", 17, True)],  # mixed: a decode row, a chunk, a prompt
    [("a", 1, True), ("b", 1, True), ("c", 1, True)],
]


@pytest.mark.parametrize("features", [AttentionFeatures(), AttentionFeatures(layer_windows=(8, -1)),
                                      AttentionFeatures(sink_logits=True, layer_windows=(-1, 5))],
                         ids=["plain", "windows", "sinks+windows"])
def test_steps_match_the_truth(features):
    assert all(f in FA3.supports("paged_decode") for f in features.requested())

    def make(kv, cfg):
        return PagedAttentionManager(kv, "cpu", kv.dtype, cfg, WRAPPERS, features=features, backend_name="fa3")

    h = Harness(make, torch.bfloat16, hq=8, d=64, page_size=16, seed=5, features=features)
    h.ingest("a", "b", "c")
    for spans in STEPS:
        err, _ = h.step(spans, causal=True)
        assert err < 2e-2, spans
