"""The probe helpers a backend's probe builds its reasons from: a library found without
importing it, and an installed version compared by its leading numeric release."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types

import pytest

from mstar_core.registry.probing import installed_version, module_missing, version_too_old, version_tuple


def test_a_module_is_found_loaded_or_on_the_path_and_named_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "fake_loaded_only", types.ModuleType("fake_loaded_only"))
    assert module_missing("fake_loaded_only", "x") == []
    assert module_missing("json", "x") == []
    assert module_missing("fake_absent_lib", "pip install absent") == [
        "fake_absent_lib is not installed (install pip install absent)"]


def test_a_module_whose_parent_is_no_package_cannot_be_located():
    (reason,) = module_missing("json.decoder.nothing", "json")
    assert reason.startswith("json.decoder.nothing cannot be located (ModuleNotFoundError: ") and reason.endswith(
        "; install json")


@pytest.mark.parametrize("raw,expected", [
    ("0.5.3.post1", (0, 5, 3)), (" 2.10 ", (2, 10)), ("7", (7,)), ("1.2rc1", (1, 2)), ("dev", ()), ("", ()),
])
def test_version_tuple_reads_the_leading_release(raw, expected):
    assert version_tuple(raw) == expected


@pytest.fixture
def versions(monkeypatch):
    """``set({distribution: version})``: what importlib.metadata reports; others are not installed."""

    def install(table: dict[str, str]) -> None:
        def version(dist):
            if dist not in table:
                raise md.PackageNotFoundError(dist)
            return table[dist]

        monkeypatch.setattr(md, "version", version)

    return install


def test_the_first_installed_distribution_answers(versions):
    versions({"b-lib": "2.0", "c-lib": "3.0"})
    assert installed_version(["a-lib", "b-lib", "c-lib"]) == ("b-lib", "2.0")
    assert installed_version(["a-lib"]) is None


@pytest.mark.parametrize("installed,reasons", [
    ("0.5.3", []), ("0.5.10", []), ("1.0", []),
    ("0.5.2", ["lib 0.5.2 is too old (0.5.3 or newer is required)"]),
    ("0.4.99", ["lib 0.4.99 is too old (0.5.3 or newer is required)"]),
])
def test_a_version_below_the_minimum_is_too_old(versions, installed, reasons):
    versions({"lib": installed})
    assert version_too_old(["other", "lib"], "0.5.3", "fake_lib_mod") == reasons


def test_without_metadata_the_module_version_is_judged(versions, fake_module):
    versions({})
    fake_module("fake_lib_new", __version__="1.4")
    fake_module("fake_lib_old", __version__="1.2")
    fake_module("fake_lib_unversioned")
    assert version_too_old(["lib"], "1.3", "fake_lib_new") == []
    assert version_too_old(["lib"], "1.3", "fake_lib_old") == ["fake_lib_old 1.2 is too old (1.3 or newer is required)"]
    assert version_too_old(["lib"], "1.3", "fake_lib_unversioned") == [
        "fake_lib_unversioned has no version metadata; 1.3 or newer is required"]
    (reason,) = version_too_old(["lib"], "1.3", "fake_lib_absent_xyz")
    assert reason.startswith("fake_lib_absent_xyz failed to import (ModuleNotFoundError: ")
