"""mstar's FlashInfer wrappers through the conformance suite on CPU, over the stand-in, in float32."""

import pytest
import torch

from mstar_core.testing import check as K
from mstar_core.testing import conformance as C
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.plugin import FLASHINFER
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

from ...helpers import case as paged_case
from ...helpers import err, oracle

FI = C.WrapperSet("flashinfer-standin", FlashInferPrefillWrapper, FlashInferDecodeWrapper, FlashInferMixedWrapper,
                  FlashInferPrefixedPrefillWrapper, device="cpu", dtype=torch.float32)

pytestmark = pytest.mark.usefixtures("standin_flashinfer")
WS = torch.empty(1024, dtype=torch.uint8)
F32 = torch.float32
CPU = torch.device("cpu")


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


# -- the features FlashInfer declares, through mstar's wrappers over the stand-in -------------------


def sinks_refused(case) -> bool:
    """A declared feature combination FlashInfer's sink variant does not compute (it has no
    soft-cap; FP8 caches are not built for it): the wrappers refuse it at plan."""
    return case.sinks and (case.kv_dtype != "auto" or case.soft_cap is not None)


def _runs(cases):
    return [c for c in cases if not sinks_refused(c)]


def _refused(cases):
    return [c for c in cases if sinks_refused(c)]


KINDS = {"prefill": "paged_prefill", "decode": "paged_decode", "mixed": "mixed"}
CHECK = {"prefill": C.check_prefill, "decode": C.check_decode, "mixed": C.check_mixed}


@pytest.mark.parametrize("case", _runs(C.feature_cases("prefill", FLASHINFER.supports("paged_prefill"))), ids=str)
def test_prefill_features(case):
    C.check_prefill(FI, case)


@pytest.mark.parametrize("case", _runs(C.feature_cases("decode", FLASHINFER.supports("paged_decode"))), ids=str)
def test_decode_features(case):
    C.check_decode(FI, case)


@pytest.mark.parametrize("case", _runs(C.feature_cases("mixed", FLASHINFER.supports("mixed"))), ids=str)
def test_mixed_features(case):
    C.check_mixed(FI, case)


@pytest.mark.parametrize("case", C.ragged_feature_cases(FLASHINFER.supports("prefixed_ragged")), ids=str)
def test_ragged_features(case):
    C.check_ragged(FI, case)


@pytest.mark.parametrize("kind,case", [(k, c) for k, cap in KINDS.items()
                                       for c in _refused(C.feature_cases(k, FLASHINFER.supports(cap)))], ids=str)
def test_sinks_with_fp8_or_soft_cap_are_refused_naming_what_runs(kind, case):
    what = r"sink logits with .*: FlashInfer's sink logits run with K/V in the query dtype .*without logits_soft_cap"
    with pytest.raises(NotImplementedError, match=what + ", on backends fa2 and fa3"):
        CHECK[kind](FI, case)


def test_sink_cases_run_on_every_paged_path():
    """Declaring sink_logits makes the suite's sink cases run (not only the refused combinations)."""
    for kind, cap in KINDS.items():
        cases = _runs(C.feature_cases(kind, FLASHINFER.supports(cap)))
        assert sum(c.sinks for c in cases) >= 4, kind  # alone and windowed, at page sizes 1 and 16


# -- what `mstar check flashinfer` adds: rows poisoned or seeing no key, re-planning ---

CLASSES = {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
           "mixed": FlashInferMixedWrapper, "prefixed_ragged": FlashInferPrefixedPrefillWrapper}
EXTRA = [c for c in K.plan_checks(FLASHINFER, CLASSES, "cpu", [torch.float32], [64, 128])
         if c.group in ("edge", "replan")]


@pytest.mark.parametrize("check", EXTRA, ids=lambda c: c.id)
def test_edge_rows_and_replanning(check):
    result = K.run_check(check)
    assert result.passed, result.message
    # FlashInfer leaves a query that sees no key undefined: the wrappers refuse such rows at plan;
    # a decode row without pages has no query left without its key, and gives zeros
    keyless = "-p-" in check.name or "_-" in check.name
    assert result.refused == (keyless and check.capability != "paged_decode"), result.message
    if result.refused:
        assert "at least as many keys as queries" in result.message


@pytest.mark.parametrize("make", ["prefill", "decode"])
def test_kv_data_type_reaches_flashinfers_plan(make):
    """``plan(..., kv_data_type=...)`` is forwarded to FlashInfer: a float16 cache under float32
    queries runs (FlashInfer checks the cache's dtype against what was planned) and matches the
    oracle within float16's precision."""
    c = paged_case((1, 1, 1), (5, 8, 2)) if make == "decode" else paged_case((3, 2), (4, 0))
    d = C.make_paged(c, "cpu", F32)
    if make == "decode":
        w = FlashInferDecodeWrapper(WS, 4, 2, 16, 4, device=CPU)
        w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_data_type=torch.float16)
    else:
        w = FlashInferPrefillWrapper(WS, 4, 2, 16, 4, device=CPU)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_data_type=torch.float16)
    half = d.layer.to(torch.float16)
    out = w.run(d.q, half)
    keys = [(k.half().double(), v.half().double()) for k, v in d.keys]  # what the float16 cache holds
    ref = oracle(c, C.PagedData(d.q, half, d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, d.kv_lens, keys))
    assert out.dtype == F32 and err(out, ref) < 2e-5
