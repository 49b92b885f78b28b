"""Every registry test starts from a clean plugin environment (``clean_env``, tests/conftest.py);
wheels are built offline where the installed setuptools can."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _clean(clean_env):
    yield


def _can_build_offline() -> bool:
    """setuptools builds wheels itself from 70.1 on; before that it needs the wheel package."""
    import setuptools

    from mstar_core.registry.probing import version_tuple

    return version_tuple(setuptools.__version__) >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="session")
def build_wheel():
    """``build_wheel(project_dir, out_dir) -> Path``: ``pip wheel --no-deps``, offline where the
    installed setuptools can (``--no-build-isolation``), else with pip's isolated build."""
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
