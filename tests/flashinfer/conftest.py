"""The FlashInfer plugin's tests: a fixture that puts the stand-in ``flashinfer`` (tests/standins)
in place of any real one for one test, and the WrapperSets the suites run."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

STANDINS = Path(__file__).resolve().parents[1] / "standins"


def _flashinfer_modules() -> list[str]:
    return [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]


# The releases whose differences the stand-in models (tests/standins/flashinfer: emulate); every
# test on the stand-in runs once on each, so each side of a version guard is exercised.
STANDIN_VERSIONS = ("0.5.3", "0.7.2.post1", "0.7.4")


def _forget():
    """No first use remembered from the stand-in (a later test, or the real library, announces anew)."""
    from mstar_core import first_use

    first_use.forget()


def _standin(monkeypatch, tmp_path, version):
    for name in _flashinfer_modules():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(STANDINS))
    mod = importlib.import_module("flashinfer")
    assert getattr(mod, "STANDIN", False), f"expected the stand-in, imported {mod.__file__}"
    mod.emulate(version)
    # a JIT folder of this test's own, and no first use remembered from another test
    monkeypatch.setattr(importlib.import_module("flashinfer.jit.env"), "FLASHINFER_JIT_DIR", tmp_path / "cached_ops")
    _forget()
    return mod


@pytest.fixture(params=STANDIN_VERSIONS, ids=lambda v: f"fi{v}")
def standin_flashinfer(monkeypatch, request, tmp_path):
    """``import flashinfer`` yields the stand-in, behaving as one FlashInfer release, for the
    duration of the test; whatever was imported before (the real library on the GPU machine) is
    restored afterwards."""
    yield _standin(monkeypatch, tmp_path, request.param)
    _forget()
    for name in _flashinfer_modules():
        del sys.modules[name]


@pytest.fixture
def standin_flashinfer_like_real(monkeypatch, tmp_path):
    """The stand-in emulating the installed FlashInfer's release where it models that release
    (the GPU tests compare the two on the same data), else its base release."""
    try:
        version = str(getattr(importlib.import_module("flashinfer"), "__version__", ""))
    except ImportError:
        version = ""
    yield _standin(monkeypatch, tmp_path, version if version in STANDIN_VERSIONS else STANDIN_VERSIONS[0])
    _forget()
    for name in _flashinfer_modules():
        del sys.modules[name]
