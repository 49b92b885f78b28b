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
