"""Fixtures for registry tests: a clean environment, fake entry points, a faked GPU, and faked
installed libraries. Nothing here touches the real installation."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as md
import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from mstar_core.registry import GROUP, reset_registry


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("MSTAR_PLUGINS", "MSTAR_STRICT_PLUGINS", "MSTAR_ATTENTION_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    reset_registry()  # a new registry also starts with no cached dense selection
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
            monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: SimpleNamespace(major=cc[0], minor=cc[1]))
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


def _can_build_offline() -> bool:
    """setuptools builds wheels itself from 70.1 on; before that it needs the wheel package."""
    import setuptools

    from mstar_core.registry.probing import version_tuple

    return version_tuple(setuptools.__version__) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="session")
def build_wheel():
    """``build_wheel(project_dir, out_dir) -> Path``: ``pip wheel --no-deps``, offline where the
    installed setuptools can (``--no-build-isolation``), else with pip's isolated build."""
    import subprocess
    from pathlib import Path

    offline = _can_build_offline()

    def build(project: Path, out: Path) -> Path:
        before = set(out.glob("*.whl")) if out.exists() else set()
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(project), "-w", str(out)]
        if offline:
            cmd.insert(5, "--no-build-isolation")
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}"
        (wheel,) = set(out.glob("*.whl")) - before
        return wheel

    return build
