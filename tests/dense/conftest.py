"""Fixtures injecting the stand-in kernel modules (tests/standins/) for CPU tests. They replace
the module in ``sys.modules`` only for the test that asks, so a real library installed on the
GPU machine is never shadowed elsewhere."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

STANDINS = pathlib.Path(__file__).resolve().parent.parent / "standins"


def _load(monkeypatch: pytest.MonkeyPatch, name: str):
    spec = importlib.util.spec_from_file_location(name, STANDINS / name / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


@pytest.fixture
def fa3_standin(monkeypatch):
    """The ``flash_attn_interface`` stand-in, returning ``out`` alone (this FA3 build's convention)."""
    return _load(monkeypatch, "flash_attn_interface")


@pytest.fixture(params=[False, True], ids=["out", "out_lse"])
def fa3_standin_both(request, monkeypatch):
    """The ``flash_attn_interface`` stand-in under both return conventions."""
    mod = _load(monkeypatch, "flash_attn_interface")
    mod.RETURN_LSE_ALWAYS = request.param
    return mod


@pytest.fixture
def aiter_standin(monkeypatch):
    return _load(monkeypatch, "aiter")


@pytest.fixture
def flashinfer_standin(monkeypatch):
    """``import flashinfer`` yields the stand-in (written by the FlashInfer plugin's tests) for
    this test; whatever was imported before is restored afterwards."""
    names = [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]
    for n in names:
        monkeypatch.delitem(sys.modules, n)
    monkeypatch.syspath_prepend(str(STANDINS))
    import importlib

    mod = importlib.import_module("flashinfer")
    assert getattr(mod, "STANDIN", False), f"expected the stand-in, imported {mod.__file__}"
    yield mod
    for n in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        del sys.modules[n]
