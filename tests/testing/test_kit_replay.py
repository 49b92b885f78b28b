"""On CUDA, the kit's replay rule proven both ways: a capturable decode wrapper whose plan fills
the captured buffers in place passes the replay group; the same wrapper whose plan binds new
buffers (so the graph replays the plan it was captured with) fails, naming the rule."""

from __future__ import annotations

import pytest
import torch

from mstar_core.testing import check as K

from . import planted_bugs as P
from . import rule_breakers as B

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
WRAPPERS = {"static_decode": B.StaticDecode, "static_decode_rebinds": B.StaticDecodeRebinds}


@pytest.fixture
def capturable(monkeypatch):
    return P.register(monkeypatch, {n: ({"paged_decode": cls}, (BF16,), {}) for n, cls in WRAPPERS.items()},
                      capturable=frozenset(WRAPPERS))


def test_a_replay_of_the_latest_plan_passes(capturable):
    report = K.check_backend("static_decode", device="cuda", registry=capturable, quick=True)
    assert report.ok, report.render(all_rows=False)
    assert "replay" in {r.group for r in report.results}


def test_a_replay_that_misses_the_new_plan_fails_naming_replay(capturable):
    report = K.check_backend("static_decode_rebinds", device="cuda", registry=capturable, quick=True)
    assert {(r.group, r.rule) for r in report.failed} == {("replay", "replay")}, report.render(all_rows=False)
