"""A real third-party plugin, as a kernel vendor would ship it: a distribution written here,
built to a wheel, installed into an isolated folder, and seen by ``mstar backends`` and by
selection in a fresh process — next to a broken plugin that must not break either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TOY_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "mstar-toy"
version = "0.0.7"
dependencies = ["mstar-core"]

[project.entry-points."mstar.backends"]
toy = "mstar_toy.plugin"

[tool.setuptools]
packages = ["mstar_toy"]
"""

TOY_PLUGIN = """
import torch
from mstar_core.registry import BackendSpec, hookimpl

@hookimpl
def mstar_register_backends(register):
    register(BackendSpec(
        name="toy",
        provides={
            "paged_prefill": "mstar_toy.wrappers:ToyPrefillWrapper",
            "paged_decode": "mstar_toy.wrappers:ToyDecodeWrapper",
            "mixed": "mstar_toy.wrappers:ToyMixedWrapper",
            "prefixed_ragged": "mstar_toy.wrappers:ToyRaggedWrapper",
        },
        devices=("cpu",),
        dtypes=(torch.float32, torch.float64),
        description="a vendor's kernels (here: the reference, subclassed)",
    ))
"""

TOY_WRAPPERS = """
from mstar_core.backends import reference as R

class ToyPrefillWrapper(R.ReferencePrefillWrapper): pass
class ToyDecodeWrapper(R.ReferenceDecodeWrapper): pass
class ToyMixedWrapper(R.ReferenceMixedWrapper): pass
class ToyRaggedWrapper(R.ReferencePrefixedPrefillWrapper): pass
"""

BROKEN_PYPROJECT = TOY_PYPROJECT.replace("mstar-toy", "mstar-broken").replace('"0.0.7"', '"3.1.4"') \
    .replace('toy = "mstar_toy.plugin"', 'broken = "mstar_broken.plugin"').replace('["mstar_toy"]', '["mstar_broken"]')

SELECT_AND_CONFORM = """
import torch
from mstar_core.registry import select_backend
from mstar_core.testing import conformance as C

caps = ("paged_prefill", "paged_decode", "mixed", "prefixed_ragged")
sel = select_backend(capabilities=caps, requested="toy", device=torch.device("cpu"), dtype=torch.float32, head_dim=64)
assert sel.name == "toy" and sel.backend.distribution == "mstar-toy" and sel.backend.version == "0.0.7", sel
assert all(c.__module__ == "mstar_toy.wrappers" for c in sel.classes.values()), sel.classes
ws = C.WrapperSet("toy", sel.classes["paged_prefill"], sel.classes["paged_decode"], sel.classes["mixed"],
                  sel.classes["prefixed_ragged"])
n = 0
for case in C.prefill_cases(page_sizes=(16,), head_dims=(64,), gqas=(4,))[:2]:
    C.check_prefill(ws, case); n += 1
for case in C.decode_cases(page_sizes=(16,), head_dims=(64,), gqas=(4,))[:1]:
    C.check_decode(ws, case); n += 1
for case in C.mixed_cases(page_sizes=(16,), head_dims=(64,), gqas=(4,))[:1]:
    C.check_mixed(ws, case); n += 1
for case in C.ragged_cases(head_dims=(64,), gqas=(4,))[:2]:
    C.check_ragged(ws, case); n += 1
auto = select_backend(capabilities=("paged_decode",), requested="auto", device="cpu", dtype=torch.float32)
print("conformance cases passed:", n, "auto:", auto.name)
"""


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip())
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory, build_wheel) -> Path:
    """An isolated install folder holding mstar-toy and mstar-broken."""
    tmp = tmp_path_factory.mktemp("third_party")
    toy = _write(tmp / "toy", {"pyproject.toml": TOY_PYPROJECT, "mstar_toy/__init__.py": "",
                               "mstar_toy/plugin.py": TOY_PLUGIN, "mstar_toy/wrappers.py": TOY_WRAPPERS})
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
    toy = next(b for b in data["backends"] if b["name"] == "toy")
    assert (toy["distribution"], toy["version"], toy["available"]) == ("mstar-toy", "0.0.7", True)
    assert toy["provides"] == ["paged_prefill", "paged_decode", "mixed", "prefixed_ragged"]
    (broken,) = [f for f in data["failed_plugins"] if f["entry_point"] == "broken"]
    assert (broken["distribution"], broken["version"], broken["stage"]) == ("mstar-broken", "3.1.4", "load")
    assert "mstar_kernel_that_is_not_there" in broken["error"]
    assert data["auto"]["paged_decode"]["pick"] == "toy"  # a vendor's plugin goes before the reference
    assert data["auto"]["bounded"]["pick"] == "reference"  # toy does not provide it

    table = _run(site, _cli())
    assert table.returncode == 0, table.stderr
    assert "toy" in table.stdout and "mstar-toy 0.0.7" in table.stdout
    assert "plugins that failed to load:" in table.stdout and "broken (mstar-broken 3.1.4) at load" in table.stdout


@pytest.mark.slow
def test_the_plugin_selected_by_name_passes_conformance(site):
    r = _run(site, ["-c", SELECT_AND_CONFORM])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "conformance cases passed: 6 auto: toy" in r.stdout


@pytest.mark.slow
def test_allowlist_and_strict_mode_in_a_fresh_process(site):
    only_toy = _run(site, _cli("--json"), MSTAR_PLUGINS="toy")
    data = json.loads(only_toy.stdout)
    assert data["failed_plugins"] == [] and data["allowlist"] == ["toy"]
    assert {b["name"] for b in data["backends"]} == {"reference", "toy"}
    strict = _run(site, _cli("--json"), MSTAR_STRICT_PLUGINS="1")
    assert strict.returncode != 0 and "mstar_kernel_that_is_not_there" in strict.stderr


@pytest.mark.slow
def test_env_naming_an_unknown_backend_lists_the_known_ones(site):
    r = _run(site, ["-c", "from mstar_core.registry import select_backend; select_backend()"],
             MSTAR_ATTENTION_BACKEND="nope")
    assert r.returncode != 0
    assert "BackendUnavailable" in r.stderr and "'nope' (from env MSTAR_ATTENTION_BACKEND) is unknown" in r.stderr
    assert "reference" in r.stderr and "toy" in r.stderr
