"""The whole kit -- every group, not only the edge and re-plan cases tests/plugins run -- over
mstar's FlashInfer, FA3 and AITER wrappers on their CPU stand-ins: they pass clean."""

from __future__ import annotations

import pytest
import torch

from mstar_core.testing import check as K


def _failures(spec, classes, dtypes, head_dims):
    checks = K.plan_checks(spec, classes, "cpu", dtypes, head_dims, quick=True)
    results = [K.run_check(c) for c in checks]
    groups = {r.group for r in results}
    assert {"plain", "shapes", "edge", "replan", "layers"} <= groups, groups
    assert ("features" in groups) == any(spec.supports(c) for c in classes), groups
    return [f"{r.capability} {r.group} {r.name}: {r.message}" for r in results if not r.passed]


@pytest.mark.usefixtures("standin_flashinfer")
def test_flashinfer_wrappers_on_the_standin():
    from mstar_flashinfer.decode import FlashInferDecodeWrapper
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.plugin import FLASHINFER
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper
    from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

    classes = {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
               "mixed": FlashInferMixedWrapper, "prefixed_ragged": FlashInferPrefixedPrefillWrapper}
    assert _failures(FLASHINFER, classes, [torch.float32], [64]) == []


def test_fa3_wrappers_on_the_standin(fa3_standin):
    from mstar_fa3.paged import FA3DecodeWrapper, FA3MixedWrapper, FA3PrefillWrapper
    from mstar_fa3.plugin import FA3
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

    classes = {"paged_prefill": FA3PrefillWrapper, "paged_decode": FA3DecodeWrapper, "mixed": FA3MixedWrapper,
               "prefixed_ragged": FA3PrefixedPrefillWrapper}
    assert _failures(FA3, classes, [torch.bfloat16], [128]) == []


def test_aiter_wrapper_on_the_standin(aiter_standin):
    from mstar_rocm.plugin import AITER
    from mstar_rocm.ragged import AiterPrefixedPrefillWrapper

    assert _failures(AITER, {"prefixed_ragged": AiterPrefixedPrefillWrapper}, [torch.bfloat16], [128]) == []
