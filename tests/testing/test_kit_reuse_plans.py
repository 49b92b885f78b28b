"""What the kit's reuse checks plan and run, seen through spy wrappers (reference wrappers that
record each plan and run): which steps one wrapper is re-planned for and with which window and
scale, the per-layer wrappers planned before any runs and run in layer order, the plan a wrapper
must refuse; and which rule each check names when a wrapper breaks it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mstar_core.backends import reference as R
from mstar_core.errors import InputError
from mstar_core.testing import reuse
from mstar_core.testing.conformance import WrapperSet
from mstar_core.testing.rules import RuleError

from . import rule_breakers as B

KINDS = {"prefill": R.ReferencePrefillWrapper, "decode": R.ReferenceDecodeWrapper,
         "mixed": R.ReferenceMixedWrapper, "ragged": R.ReferencePrefixedPrefillWrapper}


def spy(kind: str, log: list) -> WrapperSet:
    """``kind``'s reference wrapper, logging ("plan", wrapper, plan kind, window, scale, key lengths)
    and ("run", wrapper, the layer it was given)."""

    class Spy(KINDS[kind]):  # type: ignore[misc, valid-type]
        def plan(self, p, *args, **kwargs):
            lens = p.kv_lens if hasattr(p, "kv_lens") else p.cu_k[1:] - p.cu_k[:-1]
            log.append(("plan", self, getattr(p, "kind", "ragged"), p.window_left, p.sm_scale, lens.tolist()))
            return super().plan(p, *args, **kwargs)

        def run(self, q, layer, *args, **kwargs):
            log.append(("run", self, layer.clone()))
            return super().run(q, layer, *args, **kwargs)

    return WrapperSet("spy", **{kind: Spy})


def key_lens(kind: str, i: int) -> list[int]:
    q, p = reuse.STEPS[kind][i]
    return [a + b for a, b in zip(q, p, strict=True)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_replan_plans_one_wrapper_for_each_step_with_a_window_then_a_scale_then_the_first_again(kind):
    log: list = []
    reuse.check_replan(spy(kind, log), kind, head_dim=64)
    n = len(reuse.STEPS[kind])
    plans = [(w, s, lens) for _, _, _, w, s, lens in log[::2]]
    assert plans == [(-1, None, key_lens(kind, 0)), (6, None, key_lens(kind, 1)), (-1, 0.1, key_lens(kind, 2)),
                     *((-1, None, key_lens(kind, i)) for i in range(3, n)), (-1, None, key_lens(kind, 0))]
    assert [e[0] for e in log] == ["plan", "run"] * (n + 1)
    assert len({id(e[1]) for e in log}) == 1


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_layers_plan_a_wrapper_per_window_and_scale_before_any_run_then_run_each_layer_in_order(kind):
    log: list = []
    reuse.check_layers(spy(kind, log), kind, head_dim=64)
    plans, runs = log[:3], log[3:]
    assert [(w, s) for _, _, _, w, s, _ in plans] == [(-1, None), (3, 0.1), (9, 0.3)]
    assert len({str(lens) for *_, lens in plans}) == 1
    wrappers = [e[1] for e in plans]
    assert len({id(w) for w in wrappers}) == 3
    assert [e[0] for e in runs] == ["run"] * 6
    order = [next(i for i, w in enumerate(wrappers) if w is e[1]) for e in runs]
    assert order == [0, 1, 2, 1, 0, 2]
    if kind != "ragged":  # each layer on its own data
        layers = [e[2].nan_to_num() for e in runs]
        assert not any(torch.equal(a, b) for j, a in enumerate(layers) for b in layers[j + 1:])


@pytest.mark.parametrize(("kind", "refused"), [("decode", "mixed"), ("mixed", "paged_prefill"),
                                               ("prefill", "mixed"), ("ragged", "paged_prefill")])
def test_refused_plans_a_windowed_first_step_then_offers_another_capabilitys_plan(kind, refused):
    log: list = []
    reuse.check_refused(spy(kind, log), kind, head_dim=64)
    (_, w, k0, w0, s0, lens0), run1, (_, w1, k1, w1_, s1, lens1), run2 = log
    assert (k0 != refused, w0, s0, lens0) == (True, 4, 0.2, key_lens(kind, 0))
    if kind == "ragged":
        assert (k1, lens1) == (refused, [1])
    else:
        assert (k1, w1_, s1, lens1) == (refused, -1, 0.5, key_lens(kind, 2))
    assert w is w1 is run1[1] is run2[1] and (run1[0], run2[0]) == ("run", "run")


def test_refused_after_a_refused_plan_checks_the_next_plan_works():
    log: list = []

    class RefusesRunsAfterARefusal(R.ReferenceDecodeWrapper):
        def plan(self, p, *args, **kwargs):
            log.append(p.kv_lens.tolist())
            self.refused = p.kind != self.kind
            return super().plan(p, *args, **kwargs)

        def run(self, *args, **kwargs):
            if self.refused:
                raise RuntimeError("planned for nothing")
            out = super().run(*args, **kwargs)
            # the next plan's run 0.8 of the tolerance off: the error returned is the larger
            return out * (1.0 + 0.8 * B.STATED_TOLERANCE[torch.float32]) if len(log) > 2 else out

    error = reuse.check_refused(WrapperSet("x", decode=RefusesRunsAfterARefusal), "decode", head_dim=64)
    assert 0.7 < error / B.STATED_TOLERANCE[torch.float32] < 0.9
    assert log == [key_lens("decode", 0), key_lens("decode", 2), key_lens("decode", 1)]


def fails(check, backend: WrapperSet, kind: str = "decode") -> RuleError:
    with pytest.raises(RuleError) as e:
        check(backend, kind, head_dim=64)
    return e.value


def test_refused_names_a_plan_that_takes_another_capabilitys_plan():
    class TakesAnyPlan(R.ReferenceDecodeWrapper):
        def _plan(self, p):
            super()._plan(dataclasses.replace(p, kind=self.kind))

    e = fails(reuse.check_refused, WrapperSet("x", decode=TakesAnyPlan))
    assert (e.rule, e.detail) == ("unknown-keyword", "plan accepted a mixed plan")


def test_refused_names_a_plan_that_drops_an_unknown_keyword():
    e = fails(reuse.check_refused, WrapperSet("x", decode=B.DecodeDropsUnknownKeywords, api_version="1.1"))
    assert (e.rule, e.detail) == ("unknown-keyword", f"plan accepted the keyword {reuse.UNKNOWN_KEYWORD}=True")


def test_refused_names_a_refused_plan_that_left_its_scale_behind():
    e = fails(reuse.check_refused, WrapperSet("x", decode=B.DecodeScaleBeforeChecks, api_version="1.1"))
    assert e.rule == "refused-plan" and e.detail.startswith("a run after a refused plan (of [")
    assert f"with {reuse.UNKNOWN_KEYWORD}): " in e.detail


def test_replan_names_the_step_that_kept_the_last_plans_scale():
    e = fails(reuse.check_replan, WrapperSet("x", decode=B.DecodeKeepsScale))
    assert e.detail == f"step 4 of 4 on one wrapper: {e.__cause__.detail}; through a fresh wrapper it passes"
    assert e.rule == "replan"


def _after_replan(change):
    """A decode wrapper whose outputs pass through ``change`` once it has been planned again."""

    class ChangesAfterReplan(R.ReferenceDecodeWrapper):
        plans = 0

        def _plan(self, p):
            self.plans += 1
            super()._plan(p)

        def run(self, *args, **kwargs):
            out = super().run(*args, **kwargs)
            return change(out) if self.plans > 1 else out

    return ChangesAfterReplan


def test_replan_names_a_shape_wrong_only_after_a_replan():
    e = fails(reuse.check_replan, WrapperSet("x", decode=_after_replan(lambda out: out[None])))
    assert e.rule == "replan" and e.detail.startswith("step 2 of 4 on one wrapper: ")


def test_replan_names_other_rules_as_they_are():
    assert fails(reuse.check_replan, WrapperSet("x", decode=_after_replan(lambda out: out.double()))).rule == "dtype"


def test_replan_names_a_step_wrong_through_a_fresh_wrapper_too_as_wrong():
    e = fails(reuse.check_replan, WrapperSet("x", decode=B.decode_off_by(2.0)))
    assert e.rule == "oracle"

    class WrongWithAWindow(R.ReferenceDecodeWrapper):
        def _plan(self, p):
            super()._plan(dataclasses.replace(p, window_left=p.window_left + 1) if p.window_left >= 0 else p)

    assert fails(reuse.check_replan, WrapperSet("x", decode=WrongWithAWindow)).rule == "oracle"


def test_replan_names_a_first_step_wrong_as_wrong_even_when_a_fresh_wrapper_passes():
    class WrongOnTheClassFirstPlan(R.ReferenceDecodeWrapper):
        planned = False

        def _plan(self, p):
            first = not type(self).planned
            type(self).planned = True
            super()._plan(dataclasses.replace(p, sm_scale=0.5) if first else p)

    assert fails(reuse.check_replan, WrapperSet("x", decode=WrongOnTheClassFirstPlan)).rule == "oracle"


def test_layers_name_the_layer_whose_wrapper_shares_its_scale():
    e = fails(reuse.check_layers, WrapperSet("x", decode=B.DecodeScaleOnClass))
    assert e.rule == "independent-wrappers"
    assert e.detail.startswith("layer 0 (no window, the default scale) through its wrapper, one of 3 planned with "
                               "other windows and scales before any ran: ")
    assert e.detail.endswith("; through a fresh wrapper it passes")


class KnowsTheLatestPlanned(R.ReferenceDecodeWrapper):
    """Records on its class which of its wrappers was planned last (each test's subclass its own)."""

    latest = None

    def _plan(self, p):
        super()._plan(p)
        type(self).latest = self


def test_layers_name_a_windowed_layer_with_its_window_and_scale():
    class WindowFromTheLatestPlan(KnowsTheLatestPlanned):
        def run(self, *args, **kwargs):
            if type(self).latest is not self and self._planned[3] >= 0:
                self._planned = (*self._planned[:3], self._planned[3] + 1, *self._planned[4:])
                self._pad = None
            return super().run(*args, **kwargs)

    e = fails(reuse.check_layers, WrapperSet("x", decode=WindowFromTheLatestPlan))
    assert e.rule == "independent-wrappers" and e.detail.startswith("layer 1 (window 3, scale 0.1) through")


def test_layers_name_other_rules_as_they_are():
    assert fails(reuse.check_layers, WrapperSet("x", decode=B.DecodeWidensOutput)).rule == "dtype"


def test_layers_name_other_rules_as_they_are_even_where_a_fresh_wrapper_passes():
    class WidensUnlessPlannedLast(KnowsTheLatestPlanned):
        def run(self, *args, **kwargs):
            out = super().run(*args, **kwargs)
            return out if type(self).latest is self else out.double()

    assert fails(reuse.check_layers, WrapperSet("x", decode=WidensUnlessPlannedLast)).rule == "dtype"


def test_replan_names_a_plan_that_kept_the_last_page_table():
    # its rows read slots of the first step's pages: NaN there, not a wrong key
    e = fails(reuse.check_replan, WrapperSet("x", decode=B.DecodeKeepsPageTable))
    assert e.rule == "replan" and e.detail.startswith("step 2 of 4 on one wrapper: ")


def test_replan_holds_every_output_to_the_end():
    class NudgesTheLastOutputOnReplan(R.ReferenceDecodeWrapper):
        out = None

        def _plan(self, p):
            if self.out is not None:
                B.nudge(self.out)
            super()._plan(p)

        def run(self, *args, **kwargs):
            self.out = super().run(*args, **kwargs)
            return self.out

    e = fails(reuse.check_replan, WrapperSet("x", decode=NudgesTheLastOutputOnReplan))
    assert e.rule == "owned-output" and e.detail.startswith("the output of run 1 of 4, held while the later steps "
                                                            "re-planned the wrapper and ran, changed: ")


def test_replan_names_a_run_that_raises_after_a_replan_with_its_exception():
    def refuse(out):
        raise RuntimeError("no second plan")

    e = fails(reuse.check_replan, WrapperSet("x", decode=_after_replan(refuse)))
    assert (e.rule, e.error) == ("replan", None) and e.where.startswith("x decode [")
    assert e.detail == "step 2 of 4 on one wrapper: RuntimeError: no second plan; through a fresh wrapper it passes"


def test_replan_carries_the_error_of_the_step_it_names():
    e = fails(reuse.check_replan, WrapperSet("x", decode=B.DecodeKeepsScale))
    assert e.error is not None and e.error > B.STATED_TOLERANCE[torch.float32]


def off_with_a_window(window: int) -> type:
    """A decode wrapper 0.8 of the float32 tolerance off, only when planned with ``window``."""

    class OffWithAWindow(R.ReferenceDecodeWrapper):
        def run(self, *args, **kwargs):
            out = super().run(*args, **kwargs)
            return out * (1.0 + 0.8 * B.STATED_TOLERANCE[torch.float32]) if self._planned[3] == window else out

    return OffWithAWindow


@pytest.mark.parametrize(("check", "window"), [(reuse.check_replan, 6), (reuse.check_layers, 9)])
def test_replan_and_layers_return_the_largest_error(check, window):
    error = check(WrapperSet("x", decode=off_with_a_window(window)), "decode", head_dim=64)
    assert 0.7 < error / B.STATED_TOLERANCE[torch.float32] < 0.9


def test_layers_name_a_layer_wrong_through_a_fresh_wrapper_too_as_wrong():
    class WrongWithAWindow(R.ReferenceDecodeWrapper):
        def _plan(self, p):
            super()._plan(dataclasses.replace(p, window_left=p.window_left + 1) if p.window_left >= 0 else p)

    assert fails(reuse.check_layers, WrapperSet("x", decode=WrongWithAWindow)).rule == "oracle"


def test_layers_carry_where_and_the_error_of_the_layer_they_name():
    e = fails(reuse.check_layers, WrapperSet("x", decode=B.DecodeScaleOnClass))
    assert (e.where, e.error) == (e.__cause__.where, e.__cause__.error) and e.error is not None


def test_layers_hold_every_output_to_the_end():
    class NudgesTheLastOutputOfAnyWrapper(R.ReferenceDecodeWrapper):
        out = None

        def run(self, *args, **kwargs):
            if type(self).out is not None:
                B.nudge(type(self).out)
            type(self).out = super().run(*args, **kwargs)
            return type(self).out

    e = fails(reuse.check_layers, WrapperSet("x", decode=NudgesTheLastOutputOfAnyWrapper))
    assert e.rule == "owned-output" and "held while the other layers ran, changed: " in e.detail


@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_refused_passes_a_loose_wrapper_that_refuses_the_unknown_keyword(kind):
    backend = WrapperSet("x", **{kind: KINDS[kind]}, api_version="1.1")
    assert reuse.check_refused(backend, kind, head_dim=64) < 1e-5


def test_refused_names_where_and_carries_the_error_of_the_run_after_the_refusal():
    e = fails(reuse.check_refused, WrapperSet("x", decode=B.DecodeScaleBeforeChecks, api_version="1.1"))
    assert (e.where, e.error) == (e.__cause__.where, e.__cause__.error) and e.error is not None
    assert e.detail.endswith(f"with {reuse.UNKNOWN_KEYWORD}): {e.__cause__.detail}")


def test_refused_names_where_the_plan_was_accepted():
    class TakesAnyPlan(R.ReferenceDecodeWrapper):
        def _plan(self, p):
            super()._plan(dataclasses.replace(p, kind=self.kind))

    other = dataclasses.replace(reuse.steps("decode", 64)[2], window_left=-1, sm_scale=0.5)
    assert fails(reuse.check_refused, WrapperSet("x", decode=TakesAnyPlan)).where == f"x decode [{other}]"


class RunsAfterARefusal(R.ReferenceDecodeWrapper):
    """Counts the plans it refused; ``after`` says what a run after one does to its output."""

    refusals = 0

    def plan(self, p, *args, **kwargs):
        try:
            return super().plan(p, *args, **kwargs)
        except Exception:
            self.refusals += 1
            raise

    def run(self, *args, **kwargs):
        out = super().run(*args, **kwargs)
        if not self.refusals:
            self.first = out
            return out
        return self.after(out)


def test_refused_names_a_run_of_another_shape_after_a_refusal():
    class LeadingDim(RunsAfterARefusal):
        def after(self, out):
            return out[None]

    e = fails(reuse.check_refused, WrapperSet("x", decode=LeadingDim))
    assert e.rule == "refused-plan"


def test_refused_names_other_rules_of_a_run_after_a_refusal_as_they_are():
    class Widens(RunsAfterARefusal):
        def after(self, out):
            return out.double()

    e = fails(reuse.check_refused, WrapperSet("x", decode=Widens))
    assert e.rule == "dtype"


def test_refused_holds_the_first_output_to_the_end():
    class NudgesTheFirst(RunsAfterARefusal):
        def after(self, out):
            B.nudge(self.first)
            return out

    e = fails(reuse.check_refused, WrapperSet("x", decode=NudgesTheFirst))
    assert e.rule == "owned-output" and "held while a refused plan and another run followed, changed: " in e.detail


def test_refused_returns_the_largest_error():
    class Off(RunsAfterARefusal):
        def after(self, out):
            return out * (1.0 + 0.8 * B.STATED_TOLERANCE[torch.float32])

    error = reuse.check_refused(WrapperSet("x", decode=Off), "decode", head_dim=64)
    assert 0.7 < error / B.STATED_TOLERANCE[torch.float32] < 0.9


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_layer_row_sees_more_keys_than_the_widest_window(kind):
    # a window that cut no keys would pass a wrapper that ignores it
    widest = max(w for w, _ in reuse.LAYER_PLANS)
    for window, scale in reuse.LAYER_PLANS:
        case = reuse._layer_case(kind, 64, window, scale, 0)
        assert (case.window_left, case.sm_scale) == (window, scale)
        assert len(case.q_lens) > 2 and min(case.prefix_lens) > widest + 1
        assert kind == "decode" or max(case.q_lens) > 1


def test_replay_refuses_a_device_other_than_cuda():
    with pytest.raises(InputError, match=r"^check_replay needs a CUDA device, got 'cpu'$"):
        reuse.check_replay(spy("decode", []), "decode", head_dim=64)


def test_the_ragged_wrappers_foreign_plan_is_one_paged_row_of_one_key():
    case = reuse.steps("ragged", 64)[2]
    p = reuse.foreign_plan(WrapperSet("x"), "ragged", case, None)
    got = [t.tolist() for t in (p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len, p.kv_lens)]
    assert (p.kind, p.page_size, got) == ("paged_prefill", 1, [[0, 1], [0, 1], [0], [1], [1]])
