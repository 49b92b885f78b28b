"""``mstar backends --layer-windows ... --sink-logits ...``: each layer group's paged picks and
why others were passed over, in the table and the JSON; one group keeps today's output."""

from __future__ import annotations

import argparse
import json

import pytest

from mstar_core.cli import backends as cli

from ..group_fakes import FAKE, install_group_backend


@pytest.fixture(autouse=True)
def fake(fake_module, monkeypatch):
    install_group_backend(fake_module, monkeypatch)


def _run(capsys, *argv: str) -> str:
    p = argparse.ArgumentParser(prog="mstar")
    cli.register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["backends", "--device", "cpu", "--dtype", "float32", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_the_json_gives_each_group_s_picks_and_what_it_asks(capsys):
    data = json.loads(_run(capsys, "--json", "--layer-windows=128,-1,128,-1", "--sink-logits", "1,1,0,0"))
    groups = data["layer_groups"]
    assert groups["one_manager"] is False
    assert [(g["layers"], g["window"], g["sink_logits"], g["asks"]) for g in groups["groups"]] == [
        ([0], 128, True, ["sink_logits"]), ([1], -1, True, ["sink_logits"]), ([2], 128, False, []),
        ([3], -1, False, [])]
    picks = [set(g["picks"].values()) for g in groups["groups"]]
    assert picks == [{"reference"}, {"reference"}, {FAKE}, {FAKE}]
    why = groups["groups"][0]["rejected"]["paged_decode"][FAKE]
    assert why == ["does not support feature sink_logits (learned per-head sink logits in the softmax denominator) "
                   "in paged_decode"]
    assert data["features_description"] == "sink_logits on layers [0, 1], layer windows [-1, 128]"


def test_the_table_explains_each_group(capsys):
    out = _run(capsys, "--layer-windows=128,-1", "--sink-logits", "1,0")
    assert "layer groups (layers that ask the same; each group's paged capabilities from its own picks):" in out
    assert "  layers 0 (window 128, sink logits), asks sink_logits:\n    paged_prefill    reference\n" in out
    assert f"passed over {FAKE}: does not support feature sink_logits" in out
    assert f"  layers 1 (full), asks plain attention:\n    paged_prefill    {FAKE}\n" in out
    assert out.count("the paged manager is one per layer group (GroupedPagedAttentionManager)") == 1


def test_groups_with_the_whole_model_s_picks_say_one_manager_serves_them(capsys):
    out = _run(capsys, "--sink-logits", "1,1")
    assert "layer groups" not in out  # one group: today's output
    assert "the paged manager takes every paged capability from reference" in out
    data = json.loads(_run(capsys, "--json", "--layer-windows=4,-1", "--soft-cap", "30", "--sink-logits"))
    assert data["layer_groups"]["one_manager"] is True


def test_one_group_keeps_today_s_output(capsys):
    plain = _run(capsys, "--json")
    assert json.loads(plain)["layer_groups"] is None


@pytest.mark.parametrize("argv, match", [
    (("--sink-logits", "1,maybe"), r"--sink-logits '1,maybe': entry 1 \('maybe'\) must be one of 1, true, yes, 0"),
    (("--sink-logits", "1,0,1", "--layer-windows=4,-1"), "--sink-logits names 3 layers, --layer-windows 2"),
])
def test_bad_per_layer_sink_logits_are_clear_errors(capsys, argv, match):
    with pytest.raises(ValueError, match=match):
        _run(capsys, *argv)
