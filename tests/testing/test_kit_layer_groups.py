"""The kit per layer group: each group's paged picks (``auto`` or a name) checked at the group's
window and the features it asks, reported per (group, backend)."""

from __future__ import annotations

import json

import pytest
import torch

from mstar_core import AttentionFeatures, BackendSpec, BackendUnavailable, Registry
from mstar_core.attention.groups import layer_groups
from mstar_core.cli import main
from mstar_core.errors import InputError
from mstar_core.testing.check import Check, Report, Result
from mstar_core.testing.group_check import GroupReport, check_groups
from mstar_core.testing.rules import RuleError

from ..group_fakes import FAKE, WRAPPERS, install_group_backend

FEATURES = AttentionFeatures(layer_windows=(5, -1), sink_logits=(True, False))
SMALL = dict(device="cpu", dtypes=[torch.float32], head_dims=[16], quick=True)


@pytest.fixture(autouse=True)
def fake(fake_module, monkeypatch):
    install_group_backend(fake_module, monkeypatch)


def test_each_group_s_picks_run_at_the_group_s_features():
    report = check_groups("auto", FEATURES, **SMALL)
    assert report.ok, report.render(all_rows=False)
    parts = [(g.layers, name, caps) for g, name, caps, _ in report.parts]
    assert parts == [((0,), "reference", ("paged_prefill", "paged_decode", "mixed")),
                     ((1,), FAKE, ("paged_prefill", "paged_decode", "mixed"))]
    windowed, full = (r.results for *_, r in report.parts)
    assert any("sinks" in r.name and r.group == "features" for r in windowed)
    assert any(r.group == "window" and "win5" in r.name for r in windowed)
    assert not any("sinks" in r.name or r.group == "window" for r in full)  # asks nothing, full layers
    out = report.render()
    assert "layer group layers 0 (window 5, sink logits): paged_prefill, paged_decode, mixed from reference" in out
    assert out.endswith("mstar check auto: 2 of 2 (group, backend) parts passed")


def test_a_name_is_checked_on_every_group_it_serves():
    report = check_groups("reference", AttentionFeatures(sink_logits=(True, False)), **SMALL)
    assert report.ok and [(g.sink_logits, name) for g, name, _, _ in report.parts] == [(True, "reference"),
                                                                                       (False, "reference")]


def test_a_group_no_pick_serves_is_named():
    with pytest.raises(ValueError, match=r"^layers 0 \(full, sink logits\): attention backend 'fastpaged'.*sink"):
        check_groups(FAKE, AttentionFeatures(sink_logits=(True, False)), **SMALL)


def test_mstar_check_auto_with_layer_windows_and_sink_logits(capsys):
    argv = ["check", "auto", "--layer-windows=5,-1", "--sink-logits", "1,0", "--quick", "--dtype", "float32",
            "--head-dim", "16", "--device", "cpu"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and [(g["layers"], g["backend"]) for g in data["groups"]] == [([0], "reference"), ([1], FAKE)]
    assert main(argv) == 0
    assert "(group, backend) parts passed" in capsys.readouterr().out


def test_a_bad_layer_option_of_mstar_check_names_the_check_command(capsys):
    from mstar_core.cli import main

    rc = main(["check", "auto", "--layer-windows", "128,x"])
    err = capsys.readouterr().err
    assert rc != 0 and "check: --layer-windows '128,x'" in err and "backends:" not in err


def _report(*passed: bool) -> Report:
    return Report("b", "B", "2.0", "cpu", [Result("mixed", "plain", "float32", f"c{i}", p, 0.0)
                                           for i, p in enumerate(passed)], {})


def test_a_group_report_passes_only_when_every_part_passes():
    g0, g1 = layer_groups(FEATURES, 2)
    caps = ("mixed",)
    assert not GroupReport("auto", []).ok  # no part checked is no evidence
    assert GroupReport("auto", [(g0, "a", caps, _report(True)), (g1, "b", caps, _report(True, True))]).ok
    assert not GroupReport("auto", [(g0, "a", caps, _report(True)), (g1, "b", caps, _report(False, True))]).ok
    assert not GroupReport("auto", [(g0, "a", caps, _report(False)), (g1, "b", caps, _report(False))]).ok
    assert not GroupReport("auto", [(g0, "a", caps, _report(True)), (g1, "b", caps, _report())]).ok
    out = GroupReport("auto", [(g0, "a", caps, _report(True)), (g1, "b", caps, _report(False))]).render()
    # every row by default, the passing ones too
    assert ["mixed", "float32", "plain", "c0", "pass", "0.00e+00"] in [line.split() for line in out.splitlines()]
    assert out.endswith("mstar check auto: 1 of 2 (group, backend) parts passed; failed: layers 1 (full) on b")


@pytest.fixture
def planned(monkeypatch):
    """check_groups with each pick's plan stubbed (two checks per capability, the second failing
    on "mixed"), recording what each plan was asked and every event in order."""
    asked, events = [], []

    def run(cap: str, i: int) -> float:
        events.append(("run", cap, i))
        if cap == "mixed" and i == 1:
            raise RuleError("oracle", "here", "off", 0.5)
        return i / 10

    def plan(spec, classes, dev, dtypes, head_dims, quick, features, window):
        asked.append((spec.name, tuple(classes), dev, quick, window))
        return [Check(c, "plain", torch.float32, f"{spec.name}-{i}", lambda c=c, i=i: run(c, i))
                for c in classes for i in range(2)]

    monkeypatch.setattr("mstar_core.testing.group_check.plan_checks", plan)
    return asked, events


def test_every_planned_check_is_announced_then_each_result_reported_in_turn(planned):
    asked, events = planned
    report = check_groups(FAKE, AttentionFeatures(), device="cpu", on_start=lambda c: events.append(("start", len(c))),
                          on_result=lambda r: events.append(("result", r.capability, r.name, r.error)))
    (part,) = report.parts
    assert not report.ok and [r.passed for r in part[3].results] == [True, True, True, True, True, False]
    caps = ("paged_prefill", "paged_decode", "mixed")
    assert events == [("start", 6), *[e for c in caps for i, err in ((0, 0.0), (1, 0.1 if c != "mixed" else 0.5))
                                      for e in (("run", c, i), ("result", c, f"{FAKE}-{i}", err))]]


def test_the_groups_default_to_one_layer_the_full_suite_and_cuda_where_there_is_one(planned, fake_gpu):
    asked, _ = planned
    report = check_groups(FAKE, AttentionFeatures(), device="cpu")
    assert [(g.layers, g.window, name) for g, name, _, _ in report.parts] == [((0,), -1, FAKE)]
    assert asked == [(FAKE, ("paged_prefill", "paged_decode", "mixed"), torch.device("cpu"), False, -1)]
    fake_gpu("sm90")
    assert check_groups(FAKE, AttentionFeatures(), device="cpu").parts[0][3].device == "cpu"  # as asked
    with pytest.raises(BackendUnavailable, match="cuda"):  # not asked: CUDA, where fastpaged does not run
        check_groups(FAKE, AttentionFeatures())


def test_the_registry_given_is_the_one_searched_and_a_pick_may_serve_one_capability(planned):
    from mstar_core.backends.reference.plugin import REFERENCE

    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0")
    reg.register(BackendSpec(name="decodeonly", provides={"paged_decode": f"{FAKE}_mstar:"
                                                                          f"{WRAPPERS['paged_decode'].__name__}"},
                             devices=("cpu",), dtypes=(torch.float32,)), distribution="d", version="0.1")
    report = check_groups("auto", AttentionFeatures(), device="cpu", registry=reg)
    assert [(name, caps) for _, name, caps, _ in report.parts] == [("reference", ("paged_prefill", "mixed")),
                                                                   ("decodeonly", ("paged_decode",))]
    assert [r.label for *_, r in report.parts] == ["mstar-core 0", "d 0.1"]


def test_a_dtype_the_pick_does_not_declare_is_refused_before_any_check_runs(planned):
    asked, events = planned
    with pytest.raises(InputError, match=f"backend '{FAKE}': cannot check dtype float16"):
        check_groups(FAKE, AttentionFeatures(), device="cpu", dtypes=[torch.float16])
    assert asked == [] and events == []
