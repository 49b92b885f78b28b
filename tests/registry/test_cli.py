"""``mstar backends`` in process: the sub-parser, the table and the JSON on a CPU machine with
the real plugin modules (no kernel library installed) and one broken plugin."""

from __future__ import annotations

import argparse
import json

import pytest

from mstar_core.cli import backends as cli
from mstar_core.registry import Registry


@pytest.fixture
def registry(fake_entry_points, make_ep, monkeypatch):
    fake_entry_points(
        make_ep("flashinfer", "mstar_flashinfer.plugin", "mstar-flashinfer", "0.1.0"),
        make_ep("broken", "mstar_broken_plugin_xyz", "mstar-broken", "9.9"),
    )
    reg = Registry()
    monkeypatch.setattr(cli, "get_registry", lambda: reg)
    return reg


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar")
    cli.register(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["backends", *argv])


def test_json_shows_flashinfer_installed_but_unavailable_and_the_reference_picked(registry, capsys):
    args = _args("--json", "--device", "cpu")
    assert args.func is cli.run
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    fi = next(b for b in data["backends"] if b["name"] == "flashinfer")
    assert (fi["distribution"], fi["version"], fi["available"]) == ("mstar-flashinfer", "0.1.0", False)
    assert fi["reasons"] == ["runs on cuda, not on cpu", "flashinfer is not installed (install flashinfer-python>=0.5.3,<=0.7.4)"]
    assert fi["head_dims"] == "64, 128, 256" and fi["dtypes"] == ["float16", "bfloat16"]
    assert {cap: a["pick"] for cap, a in data["auto"].items()} == dict.fromkeys(
        ("paged_prefill", "paged_decode", "mixed", "prefixed_ragged", "bounded"), "reference")
    assert "flashinfer" in data["auto"]["paged_decode"]["rejected"]
    assert data["failed_plugins"] == [{"entry_point": "broken", "distribution": "mstar-broken", "version": "9.9",
                                       "stage": "load", "error": data["failed_plugins"][0]["error"]}]
    assert "mstar_broken_plugin_xyz" in data["failed_plugins"][0]["error"]


def test_table_says_when_the_env_forces_a_backend(registry, capsys, monkeypatch):
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "fa3")  # cannot run here
    args = _args("--device", "cpu")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "MSTAR_ATTENTION_BACKEND=fa3: every selection uses it" in out
    assert "paged_decode     reference" in out  # the auto column is the rule's own pick


def test_table(registry, capsys):
    args = _args("--head-dim", "64", "--device", "cpu")  # without --device a CUDA machine judges cuda
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "attention backends on cpu" in out and "head_dim 64" in out
    assert "mstar-flashinfer 0.1.0" in out and "unavailable: runs on cuda, not on cpu; flashinfer is not installed" in out
    assert "paged_decode     reference" in out and "passed over flashinfer:" in out
    assert "broken (mstar-broken 9.9) at load: ModuleNotFoundError" in out


def test_bad_dtype_is_a_clear_error(registry):
    with pytest.raises(ValueError, match="--dtype 'float9' is not a torch dtype"):
        cli.run(_args("--dtype", "float9"))
