"""What ``mstar check`` prints and dumps for a run (the Report's table, failures and summary),
what a Check and a Result are, and which head dims a declaration gets checked at."""

from __future__ import annotations

import pytest
import torch

from mstar_core import HeadDims
from mstar_core.registry.spec import BackendSpec
from mstar_core.testing.check import Check, Report, Result, default_head_dims

RESULTS = [
    Result("paged_decode", "plain", "float32", "ps16-d64", True, 1.5e-6, seconds=0.5),
    Result("mixed", "edge", "bfloat16", "p-3", True, None, "refused rows", refused=True),
    Result("paged_decode", "numerics", "float32", "long", False, 0.25, "row 2: error 2.50e-01", rule="oracle"),
    Result("mixed", "replan", "float32", "mixed-d64", False, None, "TypeError: boom", rule="runs"),
    Result("mixed", "plain", "float32", "x", False, 3e-3, "off"),
]
FAILURES = """
FAIL paged_decode float32 numerics long [oracle]:
  row 2: error 2.50e-01

FAIL mixed float32 replan mixed-d64 [runs]:
  TypeError: boom

FAIL mixed float32 plain x:
  off

not covered: bounded: no protocol

note: a note

2 of 5 cases passed (1 by refusing rows with fewer keys than queries, as the contract allows); 3 failed, by rule: \
? (1), oracle (1), runs (1)"""


def report(results=RESULTS) -> Report:
    return Report("mine", "Mine 1.0", "2.0", "cpu", list(results), {"bounded": "no protocol"}, ["a note"])


def test_the_table_aligns_every_column_to_its_widest_cell():
    assert report().render() == """mstar check mine (Mine 1.0, plugin API 2.0) on cpu

capability    dtype     group     case       result       rel. error
paged_decode  float32   plain     ps16-d64   pass         1.50e-06
mixed         bfloat16  edge      p-3        refused      -
paged_decode  float32   numerics  long       FAIL oracle  2.50e-01
mixed         float32   replan    mixed-d64  FAIL runs    -
mixed         float32   plain     x          FAIL         3.00e-03
""" + FAILURES


def test_the_failures_only_table_leaves_the_passing_rows_out():
    assert report().render(all_rows=False) == """mstar check mine (Mine 1.0, plugin API 2.0) on cpu

capability    dtype    group     case       result       rel. error
paged_decode  float32  numerics  long       FAIL oracle  2.50e-01
mixed         float32  replan    mixed-d64  FAIL runs    -
mixed         float32  plain     x          FAIL         3.00e-03
""" + FAILURES


def test_the_json_counts_and_carries_every_result():
    data = report().as_json()
    assert (data["ok"], data["passed"], data["failed"]) == (False, 2, 3)
    assert [r["seconds"] for r in data["results"]] == [0.5, 0.0, 0.0, 0.0, 0.0]  # untimed results say 0
    assert data["results"][1] == {"capability": "mixed", "group": "edge", "dtype": "bfloat16", "name": "p-3",
                                  "passed": True, "error": None, "message": "refused rows", "seconds": 0.0,
                                  "refused": True, "rule": None}
    assert report(RESULTS[:2]).ok and report(RESULTS[:2]).as_json()["failed"] == 0
    assert report(RESULTS[:2]).render().endswith(
        "\n\n2 of 2 cases passed (1 by refusing rows with fewer keys than queries, as the contract allows)")


def test_a_check_is_named_by_its_case_not_its_callable():
    a = Check("mixed", "plain", torch.float32, "d64", lambda: 0.0)
    b = Check("mixed", "plain", torch.float32, "d64", lambda: 1.0)
    assert a == b and hash(a) == hash(b) and a.id == "mixed-float32-plain-d64"
    assert "lambda" not in repr(a) and "run=" not in repr(a)


def _range(multiple_of: int, maximum: int | None = None) -> BackendSpec:
    return BackendSpec(name="r", provides={}, head_dims=HeadDims(multiple_of=multiple_of, maximum=maximum))


@pytest.mark.parametrize("multiple_of, maximum, checked", [
    (8, 256, (64, 128, 256)), (8, 512, (64, 128, 256, 512)), (16, 96, (64, 96)), (1, None, (64, 128, 256)),
    # none of 64, 128 and 256, nor the maximum: the first declared of 96, 80, 32, 192, 16, 8
    (3, None, (96,)), (5, None, (80,)), (192, None, (192,)), (16, 40, (32,)), (8, 20, (16,)), (8, 12, (8,)),
    # none of those either: nothing to check
    (13, None, ()), (43, None, ()), (257, None, ()), (97, None, ()), (27, None, ()), (11, None, ()),
    (193, None, ()), (17, None, ()), (9, None, ()),
])
def test_a_range_is_checked_at_the_usual_head_dims_it_allows(multiple_of, maximum, checked):
    assert default_head_dims(_range(multiple_of, maximum)) == checked
