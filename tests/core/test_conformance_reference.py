"""The reference backend through the conformance suite, in float32 and float64."""

import pytest
import torch

from mstar_core.backends import reference as R
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
        def plan(self, *a, **kw):
            kw["causal"] = False
            super().plan(*a, **kw)

    bad = C.WrapperSet("broken", prefill=Broken)
    case = C.prefill_cases()[0]
    assert case.causal
    with pytest.raises(AssertionError, match="relative error"):
        C.check_prefill(bad, case)
