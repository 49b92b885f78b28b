"""The kit per layer group: each group's paged picks (``auto`` or a name) checked at the group's
window and the features it asks, reported per (group, backend)."""

from __future__ import annotations

import json

import pytest
import torch

from mstar_core import AttentionFeatures
from mstar_core.cli import main
from mstar_core.testing.group_check import check_groups

from ..group_fakes import FAKE, install_group_backend

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
