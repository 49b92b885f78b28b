"""The reference backend through the conformance suite, in float32 and float64."""

import dataclasses

import pytest
import torch

from mstar_core.backends import reference as R
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.testing import conformance as C

REF = {
    dt: C.WrapperSet("reference", R.ReferencePrefillWrapper, R.ReferenceDecodeWrapper, R.ReferenceMixedWrapper,
                     R.ReferencePrefixedPrefillWrapper, dtype=dt)
    for dt in (torch.float32, torch.float64)
}
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", C.prefill_cases(), ids=str)
def test_prefill(case, dtype):
    C.check_prefill(REF[dtype], case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", C.decode_cases(), ids=str)
def test_decode(case, dtype):
    C.check_decode(REF[dtype], case)


@pytest.mark.parametrize("case", C.mixed_cases(), ids=str)
def test_mixed(case):
    C.check_mixed(REF[torch.float32], case)


@pytest.mark.parametrize("case", C.ragged_cases(), ids=str)
def test_ragged(case):
    C.check_ragged(REF[torch.float32], case)


def test_suite_catches_a_wrong_mask():
    """The suite must fail a backend that ignores the causal mask (a check that cannot fail is
    no check)."""

    class Broken(R.ReferencePrefillWrapper):
        def plan(self, plan):  # a 2.0 wrapper that reads the plan's mask wrong
            super().plan(dataclasses.replace(plan, causal=False))

    bad = C.WrapperSet("broken", prefill=Broken)
    case = C.prefill_cases()[0]
    assert case.causal
    with pytest.raises(AssertionError, match="relative error"):
        C.check_prefill(bad, case)


# -- attention features: every case the reference declares (it declares every feature) --------

PAGED_FEATURES = REFERENCE.supports("paged_prefill")


@pytest.mark.parametrize("case", C.feature_cases("prefill", PAGED_FEATURES), ids=str)
def test_prefill_features(case):
    C.check_prefill(REF[torch.float32], case)


@pytest.mark.parametrize("case", C.feature_cases("decode", REFERENCE.supports("paged_decode")), ids=str)
def test_decode_features(case):
    C.check_decode(REF[torch.float32], case)


@pytest.mark.parametrize("case", C.feature_cases("mixed", REFERENCE.supports("mixed")), ids=str)
def test_mixed_features(case):
    C.check_mixed(REF[torch.float32], case)


@pytest.mark.parametrize("case", C.ragged_feature_cases(REFERENCE.supports("prefixed_ragged")), ids=str)
def test_ragged_features(case):
    C.check_ragged(REF[torch.float32], case)


def test_feature_cases_cover_every_declared_feature():
    names = {str(c) for c in C.feature_cases("decode", PAGED_FEATURES)}
    for tag in ("fp8_e4m3", "fp8_e5m2", "cap2", "cap30", "sinks", "fp8_e4m3-cap2-sinks"):
        assert any(tag in n for n in names), tag
    assert C.feature_cases("decode", ()) == []


@pytest.mark.parametrize("drop", ["soft_cap", "sinks", "k_scale", "v_scale"])
def test_suite_catches_a_dropped_feature(drop):
    """A backend that ignores a feature it is given fails the feature cases."""

    class Dropping(R.ReferenceDecodeWrapper):
        def plan(self, plan):
            super().plan(dataclasses.replace(plan, logits_soft_cap=None) if drop == "soft_cap" else plan)

        def run(self, q, layer, **kw):
            kw.pop(drop, None)
            return super().run(q, layer, **kw)

    want = {"soft_cap": "cap2", "sinks": "sinks", "k_scale": "fp8_e4m3", "v_scale": "fp8_e4m3"}[drop]
    case = next(c for c in C.feature_cases("decode", PAGED_FEATURES) if want in str(c))
    with pytest.raises(AssertionError, match="relative error"):
        C.check_decode(C.WrapperSet("dropping", decode=Dropping), case)
