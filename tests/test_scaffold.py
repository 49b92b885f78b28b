"""The skeleton ``mstar new-backend`` writes: it passes ruff and mypy under the lint and type
configuration it carries, and every error path its wrapper writes raises mstar's own error."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from mstar_core import InputError, StateError
from mstar_core.plugin import WrapperSize, paged_plan, ragged_plan
from mstar_core.scaffold import write_skeleton

from .helpers import REPO

# mstar_core as mypy reads an installed package: followed, its own findings left to mstar's gate.
# (An editable install reaches Python through an import hook mypy cannot follow, so MYPYPATH
# names the clone instead.)
INSTALLED_CORE = '''
[[tool.mypy.overrides]]
module = ["mstar_core", "mstar_core.*"]
follow_imports = "silent"
'''


@pytest.fixture
def skeleton(tmp_path: Path) -> Path:
    root = tmp_path / "tpk"
    write_skeleton("tpk", root)
    return root


def _needs(tool: str) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (the test extra brings it)")


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


def test_the_skeleton_carries_mstars_own_lint_and_type_settings_and_pins(skeleton):
    mine = tomllib.loads((REPO / "pyproject.toml").read_text())
    theirs = tomllib.loads((skeleton / "pyproject.toml").read_text())
    assert theirs["tool"]["ruff"]["line-length"] == mine["tool"]["ruff"]["line-length"]
    assert theirs["tool"]["ruff"]["lint"]["select"] == mine["tool"]["ruff"]["lint"]["select"]
    assert {k: v for k, v in theirs["tool"]["mypy"].items() if k != "files"} == \
        {k: v for k, v in mine["tool"]["mypy"].items() if k not in ("files", "overrides")}
    pins = {re.split("==", d)[0]: d for d in mine["project"]["optional-dependencies"]["test"] if "==" in d}
    assert {"ruff", "mypy"} <= set(pins) and all(pins[t] in theirs["project"]["optional-dependencies"]["test"]
                                                 for t in ("ruff", "mypy"))


def test_the_skeleton_passes_ruff_under_its_own_config(skeleton):
    _needs("ruff")
    assert "[tool.ruff.lint]" in (skeleton / "pyproject.toml").read_text()
    r = _run(["ruff", "check", "--no-cache", "."], skeleton)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "All checks passed" in r.stdout


@pytest.mark.slow
def test_the_skeleton_passes_mypy_under_its_own_config(skeleton, tmp_path):
    _needs("mypy")
    with open(skeleton / "pyproject.toml", "a") as f:
        f.write(INSTALLED_CORE)
    cache = tmp_path / "mypy-cache"
    if (REPO / ".mypy_cache").is_dir():  # torch's analysis from mstar's own mypy run: a minute saved
        shutil.copytree(REPO / ".mypy_cache", cache)
    r = _run(["mypy", "--cache-dir", str(cache)], skeleton, MYPYPATH=str(REPO))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found in 5 source files" in r.stdout


def _ragged(skeleton: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("tpk_mstar_ragged", skeleton / "tpk_mstar" / "ragged.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_error_path_of_the_skeleton_wrapper_raises_mstar_errors(skeleton):
    W = _ragged(skeleton).PrefixedPrefillWrapper
    w = W.from_size(WrapperSize(4, 2, 8, torch.device("cpu")))
    q, k, v = torch.randn(2, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    with pytest.raises(StateError, match="run before plan"):
        w.run(q, k, v)
    with pytest.raises(InputError, match="PrefixedPrefillWrapper.plan takes a RaggedPlan, got PagedPlan"):
        one = torch.tensor([0, 1], dtype=torch.int32)
        w.plan(paged_plan("paged_prefill", one, one, one[:1], one[1:], 1, torch.float32))
    # a good plan after the refused one runs: the last query sees every key, the first query all
    # but the last (causal, aligned bottom-right)
    w.plan(ragged_plan(torch.tensor([0, 2]), torch.tensor([0, 3]), 2, 3, torch.float32))
    out = w.run(q, k, v)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    for i, seen in ((0, 2), (1, 3)):
        p = torch.softmax(torch.einsum("hd,khd->hk", q[i], kk[:seen]) / 8**0.5, dim=-1)
        torch.testing.assert_close(out[i], torch.einsum("hk,khd->hd", p, vv[:seen]))
