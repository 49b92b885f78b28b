"""The kit proves its own rules: for each rule ``mstar check`` enforces, a wrapper that breaks it
by the smallest amount it should catch (``rule_breakers.py``), registered as a third-party
backend, fails ``mstar check --quick`` on every failing case naming that rule and no other; for
each dtype's tolerance, a wrapper whose error sits just past it fails and one at 0.8 of it
passes. The device and replay rules need CUDA (``test_planted_bugs.py``, ``test_kit_replay.py``)."""

from __future__ import annotations

import pytest
import torch

from mstar_core.testing import check as K
from mstar_core.testing.rules import RULES

from . import planted_bugs as P
from . import rule_breakers as B

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
DTYPES = {"float64": F64, "float32": F32, "float16": F16, "bfloat16": BF16}
# An error this many times the stated tolerance fails the rows with few keys (bf16 rounding adds up to
# 5% of it); this many times it passes every row.
PAST, INSIDE = 1.1, 0.8

# name -> (capability -> the wrapper, its dtype, the one rule its failures name, a group of cases
# that must fail: the first to check the rule)
BREAKERS: dict[str, tuple[dict[str, type], torch.dtype, str, str]] = {
    **{f"oracle_{n}": ({"paged_decode": B.decode_off_by(PAST)}, d, "oracle", "plain") for n, d in DTYPES.items()},
    "shape": ({"paged_decode": B.DecodeLeadingDim}, F32, "shape", "plain"),
    "dtype": ({"paged_decode": B.DecodeWidensOutput}, F32, "dtype", "plain"),
    "no_key": ({"prefixed_ragged": B.RaggedNoKeySeesFirstKey}, F32, "no-key", "edge"),
    "isolation": ({"prefixed_ragged": B.RaggedRowEdgeLeak}, F32, "isolation", "edge"),
    "stale_slots": ({"paged_decode": B.DecodeOneSlotPast}, F32, "stale-slots", "plain"),
    "strided_inputs": ({"paged_decode": P.DecodeAssumesContiguous}, F32, "strided-inputs", "plain"),
    "inputs_unchanged_q": ({"prefixed_ragged": B.RaggedNudgesQ}, F32, "inputs-unchanged", "plain"),
    "inputs_unchanged_cache": ({"paged_decode": B.DecodeClearsNextSlot}, F32, "inputs-unchanged", "plain"),
    "deterministic": ({"paged_decode": B.DecodeEveryOtherRunOff}, F32, "deterministic", "plain"),
    "owned_output": ({"paged_decode": B.DecodeWritesPreviousOutput}, F32, "owned-output", "plain"),
    "replan": ({"paged_decode": B.DecodeKeepsScale}, F32, "replan", "replan"),
    "replan_page_table": ({"paged_decode": B.DecodeKeepsPageTable}, F32, "replan", "replan"),
    "refused_plan": ({"paged_decode": B.DecodeScaleBeforeChecks}, F32, "refused-plan", "replan"),
    "unknown_keyword": ({"paged_decode": B.DecodeDropsUnknownKeywords}, F32, "unknown-keyword", "replan"),
    "independent_wrappers": ({"paged_decode": B.DecodeScaleOnClass}, F32, "independent-wrappers", "layers"),
    "runs": ({"paged_decode": B.DecodeRaisesOnFullLastPage}, F32, "runs", "plain"),
}
# Within every tolerance: the kit passes them.
INSIDE_TOLERANCE = {f"inside_{n}": ({"paged_decode": B.decode_off_by(INSIDE)}, d) for n, d in DTYPES.items()}
# Rules only a CUDA machine checks, and the test that proves each.
ON_CUDA = {"device": "test_planted_bugs.py::test_the_device_plants_fail_on_cuda",
           "replay": "test_kit_replay.py::test_a_replay_that_misses_the_new_plan_fails_naming_replay"}
# A breaker's cases that another rule fails, by a substring of their name: the poisoned-row case
# leaves the unused slots clean (its NaN is the row's own), so one slot past the last key is a
# wrong key there, not NaN.
ALSO: dict[str, tuple[str, str]] = {"stale_slots": ("-poison", "oracle")}


@pytest.fixture
def breakers(monkeypatch):
    return P.register(monkeypatch, {n: (classes, (dtype,), {}) for n, (classes, dtype, *_) in
                                    {**BREAKERS, **INSIDE_TOLERANCE}.items()})


def test_every_rule_has_a_breaker():
    assert {rule for _, _, rule, _ in BREAKERS.values()} | set(ON_CUDA) == set(RULES)


@pytest.mark.parametrize("name", sorted(BREAKERS))
def test_each_rule_breaker_fails_naming_its_rule(breakers, name):
    _, _, rule, group = BREAKERS[name]
    report = K.check_backend(name, device="cpu", registry=breakers, quick=True)
    needle, other = ALSO.get(name, ("", ""))
    assert (group, rule) in {(r.group, r.rule) for r in report.failed}, report.render(all_rows=False)
    assert all(r.rule == (other if needle and needle in r.name else rule) for r in report.failed), \
        report.render(all_rows=False)


@pytest.mark.parametrize("name", sorted(INSIDE_TOLERANCE))
def test_an_error_just_inside_the_tolerance_passes(breakers, name):
    report = K.check_backend(name, device="cpu", registry=breakers, quick=True)
    assert report.ok, report.render(all_rows=False)
    # the error is there to see: about INSIDE times the tolerance
    _, dtype = INSIDE_TOLERANCE[name]
    errors = [r.error for r in report.results if r.group == "plain" and r.error is not None]
    assert INSIDE * 0.9 < min(errors) / B.STATED_TOLERANCE[dtype] < INSIDE * 1.1
