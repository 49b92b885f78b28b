"""Attention features on the dense path: an FP8 KV cache (the gathered prefix is
dequantised once per stream and layer), soft-cap, sink logits and per-layer windows, through
DenseAttentionManager against the float64 oracle."""

from __future__ import annotations

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    BackendUnavailable,
    select_backend,
)
from mstar_core.backends.reference import ReferencePrefixedPrefillWrapper
from mstar_core.testing.conformance import TOLERANCE
from mstar_fa3.plugin import FA3

from ..helpers import LABEL, Harness, dense

FEATURES = [
    pytest.param(AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=(0.5, 2.0), v_scale=0.25), id="fp8_e4m3"),
    pytest.param(AttentionFeatures(kv_dtype="fp8_e5m2"), id="fp8_e5m2"),
    pytest.param(AttentionFeatures(soft_cap=2.0), id="soft_cap"),
    pytest.param(AttentionFeatures(sink_logits=True), id="sinks"),
    pytest.param(AttentionFeatures(layer_windows=(7, -1)), id="layer_windows"),
    pytest.param(AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=0.5, soft_cap=2.0, sink_logits=True,
                                   layer_windows=(-1, 5)), id="all"),
]


def _fa3_lacks(features: AttentionFeatures) -> list[str]:
    return features.lacking("prefixed_ragged", FA3.supports("prefixed_ragged"))


# every feature on the reference; on FA3's wrapper (its stand-in), the features FA3 declares
CASES = [pytest.param("reference", p.values[0], id=f"reference-{p.id}") for p in FEATURES] + [
    pytest.param("fa3", p.values[0], id=f"fa3-{p.id}") for p in FEATURES if not _fa3_lacks(p.values[0])]


@pytest.mark.parametrize(("which", "features"), CASES)
def test_dense_steps_with_features(which, features, request):
    dtype = torch.float32
    W = ReferencePrefixedPrefillWrapper
    if which == "fa3":
        request.getfixturevalue("fa3_standin")
        from mstar_fa3.ragged import FA3PrefixedPrefillWrapper as W
        dtype = torch.bfloat16
    h = Harness(dense(W), dtype, features=features)
    h.ingest("a", "b", "c")
    err, _ = h.step([("a", 40, True), ("b", 32, True)], causal=True)
    assert err < TOLERANCE[dtype]
    for _ in range(2):  # the prefix comes back from the pages (FP8: dequantised, then cached)
        err, _ = h.step([("a", 24, False), ("b", 17, False), ("c", 5, False)], causal=True)
        assert err < TOLERANCE[dtype], err
    assert h.kv.stream("a", LABEL).length == 40
    if features.layer_windows is not None:
        (run,) = h.attn._current.label_runs  # the last step's plan (it has landed: not current)
        assert sorted(run.per_window) == sorted(set(features.layer_windows))


@pytest.mark.requires_plugin("fa3")  # selection finds FA3 by its entry point
@pytest.mark.parametrize("features", [p for p in FEATURES if _fa3_lacks(p.values[0])])
def test_fa3_is_not_selected_for_a_feature_it_does_not_declare(features):
    lacking = _fa3_lacks(features)  # the tested build has no soft-cap: selection says so, naming it
    with pytest.raises(BackendUnavailable, match=f"does not support feature {lacking[0]} "):
        select_backend(("prefixed_ragged",), requested="fa3", device="cpu", dtype=torch.bfloat16, head_dim=32,
                       features=features)


def test_fp8_prefix_is_dequantized_once_per_stream_and_layer():
    h = Harness(dense(), features=AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=0.5))
    h.ingest("a")
    h.step([("a", 40, True)])
    for _ in range(3):
        h.step([("a", 8, False)])
    assert h.attn.stats.gathers == h.cfg.num_layers  # one gather (and dequantisation) per layer
    pk, pv = h.attn.prefixes._entries[(("a", LABEL), 0)]
    assert pk.dtype == pv.dtype == torch.float32  # kept in the model dtype: the wrapper never sees FP8
