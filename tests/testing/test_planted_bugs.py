"""Each planted bug of ``planted_bugs.py``, registered in-process as a third-party backend, is
failed by ``mstar check --quick``, and every failure names the rule that caught it; the plant
that casts its output to the plan's ``dtype`` passes (that dtype is q's). The device plants run
on CUDA only."""

from __future__ import annotations

import pytest
import torch

from mstar_core.backends import reference as R
from mstar_core.cli import main
from mstar_core.testing import check as K

from . import planted_bugs as P

F32, BF16 = torch.float32, torch.bfloat16

# name -> (capability -> wrapper, dtypes, features, the rule every failure names, what a failing
# case must show: (group, substring of its name))
PLANTS: dict[str, tuple[dict[str, type], tuple[torch.dtype, ...], dict[str, tuple[str, ...]], str,
                        tuple[str, str]]] = {
    "row_tiles": ({"paged_decode": P.DecodeRowTiles}, (F32,), {}, "oracle", ("shapes", "q1x64")),
    "head_tiles": ({"paged_prefill": P.PrefillHeadTiles}, (F32,), {}, "oracle", ("shapes", "gqa16-kv4")),
    "class_window": ({"prefixed_ragged": P.RaggedClassWindow}, (F32,), {"prefixed_ragged": ("layer_windows",)},
                     "independent-wrappers", ("layers", "ragged")),
    "multi_token": ({"paged_prefill": P.PrefillMultiTokenNoCausal, "paged_decode": R.ReferenceDecodeWrapper}, (F32,),
                    {"paged_decode": ("multi_token_decode",)}, "oracle", ("features", "multi_token-")),
    "multi_token_on_decode": ({"paged_decode": P.DecodeMultiTokenNoCausal}, (F32,),
                              {"paged_decode": ("multi_token_decode",)}, "oracle", ("features", "multi_token-")),
    "persistent_output": ({"paged_decode": P.DecodePersistentOutput}, (F32,), {}, "owned-output", ("replan", "")),
    "random_splits": ({"prefixed_ragged": P.RaggedRandomSplits}, (BF16,), {}, "deterministic", ("plain", "")),
    "contiguous_ragged": ({"prefixed_ragged": P.RaggedAssumesContiguous}, (F32,), {}, "strided-inputs",
                          ("plain", "")),
    "contiguous_decode": ({"paged_decode": P.DecodeAssumesContiguous}, (F32,), {}, "strided-inputs", ("plain", "")),
    "window_only_causal": ({"paged_prefill": P.PrefillWindowOnlyCausal}, (F32,), {}, "oracle", ("plain", "full-win")),
    "whole_last_page": ({"paged_decode": P.DecodeWholeLastPage}, (F32,), {}, "stale-slots", ("plain", "")),
    "changes_then_validates": ({"paged_decode": P.DecodeChangesThenValidates}, (F32,), {}, "refused-plan",
                               ("replan", "refused-")),
    "cast_to_cache_dtype": ({"paged_decode": P.DecodeCastToCacheDtype}, (F32,), {"paged_decode": ("fp8_e4m3",)},
                            "dtype", ("features", "fp8_e4m3")),
    "writes_q_ragged": ({"prefixed_ragged": P.RaggedWritesQ}, (F32,), {}, "inputs-unchanged", ("plain", "")),
    "writes_q_decode": ({"paged_decode": P.DecodeWritesQ}, (F32,), {}, "inputs-unchanged", ("plain", "")),
}
# Written for plugin API 1.1: multi-token rows declared on (and run by) the decode wrapper.
API_1_1 = frozenset({"multi_token_on_decode"})
PASSES = {"cast_to_plan_dtype": ({"paged_decode": P.DecodeCastToPlanDtype}, (F32, BF16), {})}
ON_CUDA = {
    "output_on_host": ({"paged_decode": P.DecodeOutputOnHost}, (BF16,), {}),
    "output_on_current_device": ({"paged_decode": P.DecodeOutputOnCurrentDevice}, (BF16,), {}),
}


@pytest.fixture
def planted(monkeypatch):
    return P.register(monkeypatch, {**PLANTS, **PASSES, **ON_CUDA}, API_1_1)


@pytest.mark.parametrize("bug", sorted(PLANTS))
def test_each_planted_bug_fails_naming_its_rule(planted, bug):
    _, _, _, rule, (group, needle) = PLANTS[bug]
    torch.manual_seed(0)  # the random split counts: the same ones every time
    report = K.check_backend(bug, device="cpu", registry=planted, quick=True)
    assert not report.ok, report.render(all_rows=False)
    assert {r.rule for r in report.failed} == {rule}, report.render(all_rows=False)
    assert any(r.group == group and needle in r.name for r in report.failed), report.render(all_rows=False)
    for r in report.failed:  # the rule, the case and the largest error, in one message
        assert f"rule {rule}: " in r.message and r.name.split("-")[-1] in r.message or r.group in ("replan", "layers")
        assert r.error is not None and r.error > 0, r


def test_the_failure_messages_are_readable(planted):
    (bad, *_) = K.check_backend("random_splits", device="cpu", registry=planted, quick=True).failed
    assert "two runs of the same plan and inputs differ: largest difference" in bad.message
    assert "rule deterministic: the same plan and inputs, run twice, give bit-identical outputs" in bad.message
    assert 0 < bad.error < 0.05  # up to a few bf16 steps of the outputs
    (bad, *_) = K.check_backend("whole_last_page", device="cpu", registry=planted, quick=True).failed
    assert "NaN from slots the row does not own" in bad.message and "at token" in bad.message
    text = K.check_backend("writes_q_ragged", device="cpu", registry=planted, quick=True).render(all_rows=False)
    assert "FAIL inputs-unchanged" in text and "after a run, q changed" in text
    assert "failed, by rule: inputs-unchanged (" in text


def test_the_cli_fails_a_planted_bug_naming_the_rule(planted, monkeypatch, capsys):
    monkeypatch.setattr("mstar_core.registry.registry._default", planted)
    assert main(["check", "whole_last_page", "--quick", "--failures-only"]) == 1
    captured = capsys.readouterr()
    assert "mstar check whole_last_page: " in captured.err and " cases (paged_decode; float32; quick subset)" \
        in captured.err
    assert "FAIL paged_decode float32" in captured.err and "[stale-slots]" in captured.err
    assert "FAIL stale-slots" in captured.out and "rule stale-slots: " in captured.out


def test_casting_the_output_to_the_plans_dtype_is_harmless(planted):
    """The plan's ``dtype`` is q's dtype (the managers plan with the model's dtype, q's), so a
    cast to it is no cast: the kit passes it, and the output dtype rule stays q's dtype."""
    report = K.check_backend("cast_to_plan_dtype", device="cpu", registry=planted, quick=True)
    assert report.ok, report.render(all_rows=False)


def test_the_reference_passes_the_quick_subset_of_every_group():
    report = K.check_backend("reference", device="cpu", dtypes=[F32], quick=True)
    assert report.ok, report.render(all_rows=False)
    groups = {(r.capability, r.group) for r in report.results}
    for cap in ("paged_prefill", "paged_decode", "mixed", "prefixed_ragged"):
        assert {(cap, g) for g in ("plain", "shapes", "features", "edge", "replan", "layers")} <= groups
    names = [r.name for r in report.results]
    assert any(n.startswith("multi_token-") for n in names) and any(n.endswith("-layer_windows") for n in names)
    assert any(n.startswith("refused-") for n in names)


@pytest.mark.gpu
@pytest.mark.parametrize("bug", sorted(ON_CUDA))
def test_the_device_plants_fail_on_cuda(planted, bug):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if bug == "output_on_current_device" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: the device case puts the data on one that is not the current device")
    report = K.check_backend(bug, device="cuda", registry=planted, quick=True)
    assert {r.rule for r in report.failed} == {"device"}, report.render(all_rows=False)
    if bug == "output_on_current_device":
        assert {r.group for r in report.failed} == {"device"}
