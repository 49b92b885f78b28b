"""Fixtures any test may ask for: the stand-in kernel libraries (tests/standins/) in place of
the real ones for one test, and a plugin environment faked piece by piece (entry points, modules,
a GPU, installed libraries). Nothing here touches the real installation; a real library installed
on the GPU machine is shadowed only for the test that asks, and restored afterwards."""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.metadata as md
import importlib.util
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mstar_core import reset_registry
from mstar_core.registry import GROUP

from .helpers import STANDINS

# One intra-op thread unless OMP_NUM_THREADS says otherwise (also for the CLI's subprocesses): the
# tensors here are tiny, and on a busy 2-core machine a second thread makes each op wait for it
# (bench/cpu_threads.py measures the cost); pytest -n auto uses the cores instead.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# -- optional parts: a test that needs one carries its marker and skips, with the reason, without it

# Every module here imports the integration (which imports transformers): all are marked
# requires_transformers, and without transformers they are reported skipped instead of imported.
TRANSFORMERS_TESTS = Path(__file__).parent / "integrations" / "transformers"
# What transformers' GGUF loader needs besides transformers (mstar_core.integrations.transformers.local).
GGUF_PACKAGES = ("gguf", "accelerate")


def _absent(modules: tuple[str, ...]) -> str | None:
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    return f"needs the transformers extra ({', '.join(absent)} not installed): pip install -e '.[transformers]'"


@functools.cache
def missing_transformers() -> str | None:
    """Why tests of the transformers integration cannot run here, or None."""
    return _absent(("transformers",))


@functools.cache
def missing_gguf() -> str | None:
    """Why tests that read a GGUF file cannot run here, or None."""
    return _absent(("transformers", *GGUF_PACKAGES))


@functools.cache
def missing_plugin(name: str) -> str | None:
    """Why plugin ``name`` (``plugins/<name>``, distribution ``mstar-<name>``) is not installed
    here, or None: its tests select the backend through the registry, which finds it by its
    entry point, not by the package on the path."""
    try:
        md.distribution(f"mstar-{name}")
    except md.PackageNotFoundError:
        return f"needs the {name} plugin installed: pip install --no-deps -e ./plugins/{name}"
    return None


def _missing(item: pytest.Item) -> str | None:
    if item.get_closest_marker("requires_transformers") is not None and missing_transformers():
        return missing_transformers()
    if item.get_closest_marker("requires_gguf") is not None and missing_gguf():
        return missing_gguf()
    for mark in item.iter_markers("requires_plugin"):
        reason = missing_plugin(*mark.args, **mark.kwargs)
        if reason:
            return reason
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


class _WithoutTransformers(pytest.Module):
    """A test module whose imports need transformers, absent here: reported skipped, not imported."""

    def collect(self):
        pytest.skip(f"{self.nodeid}: {missing_transformers()}")


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.is_relative_to(TRANSFORMERS_TESTS) and missing_transformers():
        return _WithoutTransformers.from_parent(parent, path=module_path)
    return None


def pytest_collection_modifyitems(config, items):
    # The Triton interpreter must be switched on before anything imports triton: its tests first.
    items.sort(key=lambda item: "triton_interp" not in getattr(item, "fixturenames", ()))
    # Tests that need a GPU, the transformers extra or a plugin skip cleanly without it; decided
    # once, here.
    for item in items:
        if item.path.is_relative_to(TRANSFORMERS_TESTS):
            item.add_marker(pytest.mark.requires_transformers)
        reason = _missing(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


# -- stand-in kernel libraries -------------------------------------------------------------------


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


def _flashinfer_modules() -> list[str]:
    return [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]


def _swap_in_flashinfer(monkeypatch: pytest.MonkeyPatch):
    """``import flashinfer`` yields the stand-in until ``_drop_flashinfer`` (monkeypatch then
    restores whatever was imported before)."""
    for name in _flashinfer_modules():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(STANDINS))
    mod = importlib.import_module("flashinfer")
    assert getattr(mod, "STANDIN", False), f"expected the stand-in, imported {mod.__file__}"
    return mod


def _drop_flashinfer() -> None:
    for name in _flashinfer_modules():
        del sys.modules[name]


@pytest.fixture
def flashinfer_standin(monkeypatch):
    """``import flashinfer`` yields the stand-in (as it is, its base release) for this test."""
    yield _swap_in_flashinfer(monkeypatch)
    _drop_flashinfer()


# The releases whose differences the stand-in models (tests/standins/flashinfer: emulate); every
# test on ``standin_flashinfer`` runs once on each, so each side of a version guard is exercised.
STANDIN_VERSIONS = ("0.5.3", "0.7.2.post1", "0.7.4")


def _forget_first_uses() -> None:
    """No first use remembered from the stand-in (a later test, or the real library, announces anew)."""
    from mstar_core import first_use

    first_use.forget()


def _standin_as(monkeypatch, tmp_path, version):
    mod = _swap_in_flashinfer(monkeypatch)
    mod.emulate(version)
    # a JIT folder of this test's own, and no first use remembered from another test
    monkeypatch.setattr(importlib.import_module("flashinfer.jit.env"), "FLASHINFER_JIT_DIR", tmp_path / "cached_ops")
    _forget_first_uses()
    return mod


@pytest.fixture(params=STANDIN_VERSIONS, ids=lambda v: f"fi{v}")
def standin_flashinfer(monkeypatch, request, tmp_path):
    """``import flashinfer`` yields the stand-in, behaving as one FlashInfer release, for the
    duration of the test (once per release in ``STANDIN_VERSIONS``)."""
    yield _standin_as(monkeypatch, tmp_path, request.param)
    _forget_first_uses()
    _drop_flashinfer()


@pytest.fixture
def standin_flashinfer_like_real(monkeypatch, tmp_path):
    """The stand-in emulating the installed FlashInfer's release where it models that release
    (the GPU tests compare the two on the same data), else its base release."""
    try:
        version = str(getattr(importlib.import_module("flashinfer"), "__version__", ""))
    except ImportError:
        version = ""
    yield _standin_as(monkeypatch, tmp_path, version if version in STANDIN_VERSIONS else STANDIN_VERSIONS[0])
    _forget_first_uses()
    _drop_flashinfer()


# -- a faked plugin environment ------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    """No MSTAR_* selection variable set, and a fresh registry (which also starts with no cached
    dense selection) before and after the test. Autouse under tests/registry/."""
    for var in ("MSTAR_PLUGINS", "MSTAR_STRICT_PLUGINS", "MSTAR_ATTENTION_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    yield
    reset_registry()


def _make_ep(name: str, value: str, dist: str = "mstar-fake", version: str = "1.0") -> md.EntryPoint:
    ep = md.EntryPoint(name=name, value=value, group=GROUP)
    return ep._for(SimpleNamespace(name=dist, version=version))


@pytest.fixture
def make_ep():
    """``make_ep(name, "module", dist, version)``: an entry point of a (fake) distribution."""
    return _make_ep


@pytest.fixture
def fake_entry_points(monkeypatch):
    """``install(*eps)``: the group then holds exactly these (the built-in reference is added by
    discovery as it is when metadata lacks it)."""

    def install(*eps: md.EntryPoint) -> None:
        def entry_points(**kw):
            return list(eps) if kw.get("group") == GROUP else []

        monkeypatch.setattr(md, "entry_points", entry_points)

    return install


@pytest.fixture
def fake_module(monkeypatch):
    """``add(name, **attrs)``: a module importable by ``name`` for this test only."""

    def add(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(mod, k, v)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    return add


@pytest.fixture
def fake_gpu(monkeypatch):
    """``set(arch)``: "sm80", "sm90" (NVIDIA) or "gfx942" (ROCm) as device 0."""

    def set_arch(arch: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        if arch.startswith("sm"):
            cc = (int(arch[2:-1]), int(arch[-1]))
            monkeypatch.setattr(torch.version, "hip", None)
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: cc)
            monkeypatch.setattr(torch.cuda, "get_device_properties",
                                lambda i=None: SimpleNamespace(major=cc[0], minor=cc[1]))
        else:
            monkeypatch.setattr(torch.version, "hip", "6.3.0")
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 4))
            monkeypatch.setattr(torch.cuda, "get_device_properties",
                                lambda i=None: SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-"))

    return set_arch


@pytest.fixture
def fake_installed(monkeypatch):
    """``set({module: version_or_None})``: these modules are found by find_spec (without existing)
    and their distributions report the version; every other lookup is real."""
    real_find_spec, real_version = importlib.util.find_spec, md.version
    dists = {"flashinfer": "flashinfer-python", "flash_attn_interface": "tokenspeed-fa3", "aiter": "amd-aiter"}

    def set_installed(modules: dict[str, str | None]) -> None:
        versions = {dists.get(m, m): v for m, v in modules.items() if v is not None}

        def find_spec(name, package=None):
            if name in modules:
                return importlib.machinery.ModuleSpec(name, loader=None)
            return real_find_spec(name, package)

        def version(dist):
            return versions[dist] if dist in versions else real_version(dist)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        monkeypatch.setattr(md, "version", version)

    return set_installed
