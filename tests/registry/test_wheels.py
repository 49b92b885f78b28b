"""Each backend distribution's wheel holds its own package and nothing else, and declares its
entry point and its dependencies. Built from a copy of the tree (beside decoy packages), so a
stale build/ folder in the checkout cannot hide or add a file."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from ..helpers import REPO

pytestmark = pytest.mark.slow  # every test builds a wheel
PACKAGES = ("mstar_flashinfer", "mstar_fa3", "mstar_rocm")
KERNEL_DEPENDENCY = {"flashinfer": "flashinfer-python<=0.7.4,>=0.5.3", "fa3": None, "rocm": "amd-aiter"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, root / pkg, ignore=ignore)
    shutil.copytree(REPO / "plugins", root / "plugins", ignore=ignore, symlinks=True)  # links stay links
    (root / "mstar_core").mkdir()  # a decoy: the core must never ride along in a plugin wheel
    (root / "mstar_core" / "__init__.py").write_text("")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["flashinfer", "fa3", "rocm"])
def test_wheel_holds_only_its_package(tree, tmp_path, build_wheel, plugin):
    wheel = build_wheel(tree / "plugins" / plugin, tmp_path)
    package = f"mstar_{plugin}"
    assert wheel.name.startswith(f"mstar_{plugin}-0.1.0-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{dist_info}/METADATA").decode()
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    top = {n.split("/")[0] for n in names}
    assert top == {package, dist_info}, f"{wheel.name} holds {sorted(top)}"
    expected = {p.relative_to(tree).as_posix() for p in (tree / package).rglob("*") if p.is_file()}
    assert {n for n in names if n.startswith(package + "/")} == expected
    for must in ("plugin.py", "probe.py", "__init__.py", "py.typed"):
        assert f"{package}/{must}" in names
    assert f"Name: mstar-{plugin}" in metadata
    assert "Requires-Dist: mstar-core>=0.1" in metadata
    if KERNEL_DEPENDENCY[plugin]:
        assert f"Requires-Dist: {KERNEL_DEPENDENCY[plugin]}" in metadata
    else:  # FA3: any build providing flash_attn_interface; the known prebuilt is an extra
        assert 'Requires-Dist: tokenspeed-fa3; extra == "tokenspeed"' in metadata
    assert "[mstar.backends]" in entry_points and f"{plugin} = {package}.plugin" in entry_points


@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["flashinfer", "fa3", "rocm"])
def test_wheel_built_from_the_sdist_is_whole(tree, tmp_path, build_wheel, plugin):
    """What `python -m build` does: an sdist first, then the wheel from the unpacked sdist. The
    sdist must carry the package (not only the packaging), or that wheel would be empty."""
    import subprocess
    import sys
    import tarfile

    project = tree / "plugins" / plugin
    out = tmp_path / "sdist"
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=project, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    sdist = out / r.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as t:
        t.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheel = build_wheel(unpacked, tmp_path / "wheel")
    package = f"mstar_{plugin}"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    expected = {p.relative_to(tree).as_posix() for p in (tree / package).rglob("*") if p.is_file()}
    assert {n for n in names if n.startswith(package + "/")} == expected


@pytest.mark.slow
def test_core_wheel_holds_only_mstar_core(tmp_path, build_wheel):
    """`pip wheel .` at the root: mstar_core alone (no backend package, no tests), typed, with
    the `mstar` console script and the reference backend's entry point."""
    root = tmp_path / "core"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    shutil.copytree(REPO / "mstar_core", root / "mstar_core", ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, root / f)
    for decoy in ("mstar_flashinfer", "tests"):  # beside it in the checkout, never in its wheel
        (root / decoy).mkdir()
        (root / decoy / "__init__.py").write_text("")
    wheel = build_wheel(root, tmp_path / "out")
    assert wheel.name.startswith("mstar_core-0.1.0-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert {n.split("/")[0] for n in names} == {"mstar_core", dist_info}
    assert "mstar_core/py.typed" in names and "mstar_core/registry/hookspecs.py" in names
    assert "mstar = mstar_core.cli:main" in entry_points
    assert "reference = mstar_core.backends.reference.plugin" in entry_points
