"""A real third-party plugin, as a kernel vendor would ship it: a distribution written here,
built to a wheel, installed into an isolated folder, and seen by ``mstar backends`` and by
selection in a fresh process — next to a broken plugin that must not break either."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..helpers import REPO

pytestmark = pytest.mark.slow  # every test builds and installs wheels and runs fresh processes
DOC = REPO / "docs" / "PLUGINS.md"

BROKEN_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "mstar-broken"
version = "3.1.4"
dependencies = ["mstar-core"]

[project.entry-points."mstar.backends"]
broken = "mstar_broken.plugin"

[tool.setuptools]
packages = ["mstar_broken"]
"""


def files_from_doc() -> dict[str, str]:
    """The example distribution of docs/PLUGINS.md: each fenced block after ``<!-- file: PATH -->``."""
    files = dict(re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", DOC.read_text(), re.S))
    assert {"pyproject.toml", "plainattn_mstar/plugin.py", "plainattn_mstar/wrappers.py"} <= set(files), sorted(files)
    return files


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip())
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory, build_wheel) -> Path:
    """An isolated install folder holding docs/PLUGINS.md's plainattn-mstar, built from that page
    alone, and mstar-broken."""
    tmp = tmp_path_factory.mktemp("third_party")
    toy = _write(tmp / "plainattn", files_from_doc())
    broken = _write(tmp / "broken", {"pyproject.toml": BROKEN_PYPROJECT, "mstar_broken/__init__.py": "",
                                     "mstar_broken/plugin.py": "import mstar_kernel_that_is_not_there\n"})
    wheels = [build_wheel(toy, tmp / "wheels"), build_wheel(broken, tmp / "wheels")]
    target = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(target), *map(str, wheels)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return target


def _run(site: Path, args: list[str], **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSTAR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    env.update(env_extra)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=site.parent)


def _cli(*args: str) -> list[str]:
    # The lead's `mstar` entry point; `python -m mstar_core.cli` is the same main().
    return ["-m", "mstar_core.cli", "backends", *args]


@pytest.mark.slow
def test_mstar_backends_lists_the_plugin_and_the_broken_one(site):
    r = _run(site, _cli("--json"))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    plain = next(b for b in data["backends"] if b["name"] == "plainattn")
    assert (plain["distribution"], plain["version"], plain["available"]) == ("plainattn-mstar", "0.1.0", True)
    assert plain["provides"] == ["paged_decode", "prefixed_ragged"] and plain["api_version"] == "2.0"
    (broken,) = [f for f in data["failed_plugins"] if f["entry_point"] == "broken"]
    assert (broken["distribution"], broken["version"], broken["stage"]) == ("mstar-broken", "3.1.4", "load")
    assert "mstar_kernel_that_is_not_there" in broken["error"]
    # a vendor's plugin goes before the reference, as PLUGINS.md says
    assert data["auto"]["paged_decode"]["pick"] == "plainattn"
    assert data["auto"]["prefixed_ragged"]["pick"] == "plainattn"
    assert data["auto"]["bounded"]["pick"] == "reference"  # plainattn does not provide it
    # a decode-only plugin written for 1.0 serves the paged manager's decode steps
    assert data["paged"]["picks"] == {"paged_prefill": "reference", "paged_decode": "plainattn", "mixed": "reference"}

    table = _run(site, _cli())
    assert table.returncode == 0, table.stderr
    assert "plainattn" in table.stdout and "plainattn-mstar 0.1.0" in table.stdout
    assert "plugins that failed to load:" in table.stdout and "broken (mstar-broken 3.1.4) at load" in table.stdout


@pytest.mark.slow
def test_the_plugin_passes_mstar_check_and_its_own_pytest_entry(site, tmp_path):
    r = _run(site, ["-m", "mstar_core.cli", "check", "plainattn", "--quick"])  # every group, fewer cases
    assert r.returncode == 0, r.stdout + r.stderr
    counts = re.search(r"(\d+) of (\d+) cases passed", r.stdout)
    assert counts and counts[1] == counts[2] and int(counts[1]) > 50, r.stdout
    for group in ("plain", "edge", "replan"):
        assert f" {group} " in r.stdout
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_conformance.py").write_text(files_from_doc()["tests/test_conformance.py"])
    p = _run(site, ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)])
    assert p.returncode == 0 and re.search(r"\d+ passed", p.stdout), p.stdout + p.stderr


@pytest.mark.slow
def test_allowlist_and_strict_mode_in_a_fresh_process(site):
    only_plain = _run(site, _cli("--json"), MSTAR_PLUGINS="plainattn")
    data = json.loads(only_plain.stdout)
    assert data["failed_plugins"] == [] and data["allowlist"] == ["plainattn"]
    assert {b["name"] for b in data["backends"]} == {"reference", "plainattn"}
    strict = _run(site, _cli("--json"), MSTAR_STRICT_PLUGINS="1")
    assert strict.returncode == 2, strict.stderr
    assert strict.stderr.startswith("mstar backends: error: strict mode: plugin 'broken' (mstar-broken 3.1.4")
    assert "mstar_kernel_that_is_not_there" in strict.stderr and "Traceback" not in strict.stderr


@pytest.mark.slow
def test_env_naming_an_unknown_backend_lists_the_known_ones(site):
    r = _run(site, ["-c", "from mstar_core.registry import select_backend; select_backend()"],
             MSTAR_ATTENTION_BACKEND="nope")
    assert r.returncode != 0
    assert "BackendUnavailable" in r.stderr and "'nope' (from env MSTAR_ATTENTION_BACKEND) is unknown" in r.stderr
    assert "reference" in r.stderr and "plainattn" in r.stderr


# -- mstar new-backend: the skeleton installs and passes as generated ----------------------------

@pytest.mark.slow
def test_new_backend_skeleton_installs_and_passes_mstar_check(tmp_path, build_wheel):
    from mstar_core.cli import main

    project = tmp_path / "tpk"
    assert main(["new-backend", "tpk", str(project)]) == 0
    assert (project / "tpk_mstar" / "plugin.py").exists() and (project / "tests" / "test_conformance.py").exists()
    wheel = build_wheel(project, tmp_path / "wheels")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                        str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    listed = json.loads(_run(site, _cli("--json")).stdout)
    (tpk,) = [b for b in listed["backends"] if b["name"] == "tpk"]
    assert (tpk["distribution"], tpk["available"], tpk["api_version"]) == ("tpk-mstar", True, "2.0")
    check = _run(site, ["-m", "mstar_core.cli", "check", "tpk"])
    assert check.returncode == 0, check.stdout + check.stderr
    counts = re.search(r"(\d+) of (\d+) cases passed", check.stdout)
    assert counts and counts[1] == counts[2], check.stdout
    p = _run(site, ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(project / "tests")])
    assert p.returncode == 0 and re.search(r"\d+ passed", p.stdout), p.stdout + p.stderr
