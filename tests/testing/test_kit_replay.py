"""On CUDA, the kit's replay rule proven both ways: a capturable decode wrapper whose plan fills
the captured buffers in place passes the replay group; the same wrapper whose plan binds new
buffers (so the graph replays the plan it was captured with) fails, naming the rule. Then what
the replay check itself does, through capturable wrappers of each paged kind that record their
plans: the first step planned to capture, every step planned again before its replay, a step of
multi-token rows on the prefill wrapper when asked, the largest error returned, and a rule other
than the oracle's passed on under its own name."""

from __future__ import annotations

import pytest
import torch

from mstar_core.testing import check as K
from mstar_core.testing import reuse
from mstar_core.testing.conformance import TOLERANCE, WrapperSet
from mstar_core.testing.rules import RuleError

from . import planted_bugs as P
from . import rule_breakers as B

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
WRAPPERS = {"static_decode": B.StaticDecode, "static_decode_rebinds": B.StaticDecodeRebinds}
CLASSES = {"decode": B.StaticDecode, "prefill": B.StaticPrefill, "mixed": B.StaticMixed}


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


def recording(cls: type, log: list) -> type:
    """``cls``, logging ("plan", head dim, query lengths or None, key lengths, where the page
    indices are) for each plan and ("run",) for each run Python sees (a replay is not one)."""

    class Recording(cls):  # type: ignore[misc, valid-type]
        def plan(self, *arrays, **kwargs):
            qo, rest = (None, arrays) if len(arrays) == 3 else (arrays[0], arrays[1:])
            keys = [seen for _, seen in B.paged_rows(*rest, self.page_size)]
            q_lens = None if qo is None else (qo[1:] - qo[:-1]).tolist()
            log.append(("plan", self.head_dim, q_lens, keys, rest[1].device.type))
            return super().plan(*arrays, **kwargs)

        def run(self, *args, **kwargs):
            log.append(("run",))
            return super().run(*args, **kwargs)

    return Recording


def wrapper_set(kind: str, cls: type, dtype: torch.dtype = BF16, device_indices: bool = False) -> WrapperSet:
    return WrapperSet("static", **{kind: cls}, device="cuda", dtype=dtype, api_version="1.0",
                      device_indices=device_indices)


def expected_plans(kind: str, multi: bool) -> list[tuple[list[int] | None, list[int]]]:
    """(query lengths or None, key lengths) of each plan: the first step's to capture, then each step's."""
    steps = [*reuse.STEPS[kind], *([reuse.MULTI_TOKEN_STEP] if multi else [])]
    plans = [(None if kind == "decode" else list(q), [a + b for a, b in zip(q, p, strict=True)]) for q, p in steps]
    return [plans[0], *plans]


@pytest.mark.parametrize(("kind", "multi_token"), [("decode", False), ("decode", True), ("prefill", False),
                                                   ("prefill", True), ("mixed", False), ("mixed", True)])
@pytest.mark.parametrize("device_indices", [False, True])
def test_replay_captures_the_first_plan_then_plans_and_replays_every_step(kind, multi_token, device_indices):
    log: list = []
    ws = wrapper_set(kind, recording(CLASSES[kind], log), device_indices=device_indices)
    error = reuse.check_replay(ws, kind, 64, multi_token=multi_token)
    assert 0.0 < error <= TOLERANCE[BF16]
    plans = [e for e in log if e[0] == "plan"]
    assert [(q, keys) for _, _, q, keys, _ in plans] == expected_plans(kind, multi_token and kind == "prefill")
    assert {d for *_, d in plans} == {"cuda" if device_indices and kind != "mixed" else "cpu"}
    assert {h for _, h, *_ in plans} == {64}
    # the warm-up run and the captured one; every replay after them runs no Python
    assert [e[0] for e in log] == ["plan", "run", "run", *["plan"] * (len(plans) - 1)]


def test_replay_checks_head_dim_128_unless_told():
    log: list = []
    reuse.check_replay(wrapper_set("decode", recording(B.StaticDecode, log)), "decode")
    assert {e[1] for e in log if e[0] == "plan"} == {128}


def test_replay_with_multi_token_rows_catches_a_kernel_that_drops_causal_for_them():
    ws = wrapper_set("prefill", B.StaticPrefillMultiTokenNoCausal)
    assert reuse.check_replay(ws, "prefill", 64) <= TOLERANCE[BF16]
    with pytest.raises(RuleError) as e:
        reuse.check_replay(ws, "prefill", 64, multi_token=True)
    assert e.value.rule == "replay" and "-q4_4_4_4_4_4_4_4-" in e.value.where


def test_replay_returns_the_largest_error_of_its_steps():
    ws = wrapper_set("decode", B.StaticDecodeScaledStep, dtype=torch.float32)
    error = reuse.check_replay(ws, "decode", 64)
    assert B.StaticDecodeScaledStep.GAIN / 2 < error <= TOLERANCE[torch.float32]


def test_replay_passes_a_rule_other_than_the_oracles_on_under_its_own_name():
    with pytest.raises(RuleError) as e:
        reuse.check_replay(wrapper_set("decode", B.StaticDecodeLeadingDim), "decode", 64)
    assert e.value.rule == "shape"
