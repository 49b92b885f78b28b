"""mstar's FlashInfer wrappers through the conformance suite on CPU, over the stand-in, in float32."""

import pytest
import torch

from mstar_core.testing import conformance as C
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

FI = C.WrapperSet("flashinfer-standin", FlashInferPrefillWrapper, FlashInferDecodeWrapper, FlashInferMixedWrapper,
                  FlashInferPrefixedPrefillWrapper, device="cpu", dtype=torch.float32)

pytestmark = pytest.mark.usefixtures("standin_flashinfer")


@pytest.mark.parametrize("case", C.prefill_cases(), ids=str)
def test_prefill(case):
    C.check_prefill(FI, case)


@pytest.mark.parametrize("case", C.decode_cases(), ids=str)
def test_decode(case):
    C.check_decode(FI, case)


@pytest.mark.parametrize("case", C.mixed_cases(), ids=str)
def test_mixed(case):
    C.check_mixed(FI, case)


@pytest.mark.parametrize("case", C.ragged_cases(), ids=str)
def test_ragged(case):
    C.check_ragged(FI, case)


# -- the features FlashInfer declares (issue 13), through mstar's wrappers over the stand-in ------

from mstar_flashinfer.plugin import FLASHINFER


@pytest.mark.parametrize("case", C.feature_cases("prefill", FLASHINFER.supports("paged_prefill")), ids=str)
def test_prefill_features(case):
    C.check_prefill(FI, case)


@pytest.mark.parametrize("case", C.feature_cases("decode", FLASHINFER.supports("paged_decode")), ids=str)
def test_decode_features(case):
    C.check_decode(FI, case)


@pytest.mark.parametrize("case", C.feature_cases("mixed", FLASHINFER.supports("mixed")), ids=str)
def test_mixed_features(case):
    C.check_mixed(FI, case)


@pytest.mark.parametrize("case", C.ragged_feature_cases(FLASHINFER.supports("prefixed_ragged")), ids=str)
def test_ragged_features(case):
    C.check_ragged(FI, case)


def test_sink_logits_are_refused_not_dropped():
    """FlashInfer 0.5.3 drops ``sinks`` off trtllm-gen: the wrappers refuse them (the backend
    does not declare the feature) rather than compute without them."""
    case = C.PagedCase(16, 64, 4, (1, 1), (3, 20), sinks=True)
    with pytest.raises(NotImplementedError, match="sink logits are not supported by the FlashInfer backend"):
        C.check_decode(FI, case)


# -- what `mstar check flashinfer` adds (issue 15): rows poisoned or seeing no key, re-planning ---

from mstar_core.testing import check as K

CLASSES = {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
           "mixed": FlashInferMixedWrapper, "prefixed_ragged": FlashInferPrefixedPrefillWrapper}
EXTRA = [c for c in K.plan_checks(FLASHINFER, CLASSES, "cpu", [torch.float32], [64, 128]) if c.group in ("edge", "replan")]


@pytest.mark.parametrize("check", EXTRA, ids=lambda c: c.id)
def test_edge_rows_and_replanning(check):
    result = K.run_check(check)
    assert result.passed, result.message
    # FlashInfer leaves a query that sees no key undefined: the wrappers refuse such rows at plan
    assert result.refused == ("-p-" in check.name or "_-" in check.name), result.message
    if result.refused:
        assert "at least as many keys as queries" in result.message
