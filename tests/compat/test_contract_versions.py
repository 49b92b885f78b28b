"""A plugin written for an earlier plugin API version runs unchanged on this core (docs/PLUGINS.md,
section 2). Each frozen fixture (tests/compat/fixtures) is built to a wheel outside the repository,
installed into a folder of its own and run in fresh processes: `mstar check`, the tiny-model demos
under every way a backend is selected, the paged manager under each feature, and a copy with one
wrong line that `mstar check` must fail."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..helpers import REPO

pytestmark = pytest.mark.slow  # builds and installs wheels, and every test runs fresh processes
HERE = Path(__file__).parent


@dataclass(frozen=True)
class Fixture:
    api_version: str
    folder: str  # under tests/compat/fixtures
    name: str  # its backend's name; its package is NAME_mstar
    multi_token_wrappers: tuple[str, ...]  # where `mstar check` runs multi-token decode rows
    planted: tuple[str, str]  # (a line of wrappers.py, the wrong line planted in its place)
    planted_cases: str  # what the planted line breaks: a regex every failing case's "GROUP NAME" matches


FIXTURES = (
    # 1.0: declared on paged_decode, the rows ran on the prefill wrapper; the soft cap planted before sm_scale
    Fixture("1.0", "api_1_0", "compat10attn", ("paged_prefill",),
            ("scores = soft_cap * torch.tanh(scores / soft_cap)",
             "scores = soft_cap * torch.tanh(scores / scale / soft_cap) * scale"), "-cap"),
    # 1.1: declared on both wrappers, each runs them; the sink logits planted as ignored
    Fixture("1.1", "api_1_1", "compat11attn", ("paged_decode", "paged_prefill"),
            ("if sinks is not None:  # exp", "if False:  # exp"), "-sinks"),
    # 2.0: plan objects; the plan's window planted as ignored (the re-plan and per-layer groups plan windows)
    Fixture("2.0", "api_2_0", "compat20attn", ("paged_decode", "paged_prefill"),
            ("if window_left >= 0:", "if False:"), r"-win\d|^(replan|layers) "),
)
BY_VERSION = pytest.mark.parametrize("fx", FIXTURES, ids=lambda f: f.api_version)


@pytest.fixture(scope="module")
def sites(tmp_path_factory, build_wheel) -> Callable[[Fixture], Path]:
    """``sites(fx)``: an isolated install folder holding that fixture alone, built on first use
    (so an xdist worker builds only the fixtures its tests use) from a copy of it (a build writes
    build/ and *.egg-info beside its sources)."""
    tmp = tmp_path_factory.mktemp("compat")

    @functools.cache
    def site(fx: Fixture) -> Path:
        src = shutil.copytree(HERE / "fixtures" / fx.folder, tmp / "src" / fx.folder)
        return _install(build_wheel(src, tmp / "wheels"), tmp / f"site-{fx.folder}")

    return site


def _install(wheel: Path, target: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(target), str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return target


def _run(site: Path, args: list[str], cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in a fresh process that sees ``site`` and this checkout's mstar_core."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSTAR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    env.update(env_extra)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd)


def _check(site: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return _run(site, ["-m", "mstar_core.cli", "check", name, *extra], site.parent)


@BY_VERSION
def test_mstar_check_passes(sites, fx):
    # Every group at head dims 64 and 128, not --quick (the numerics' long rows at 256 are the kit's
    # own tests' to prove, tests/testing; here the contract versions are on trial).
    r = _check(sites(fx), fx.name, "--head-dim", "64", "--head-dim", "128")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert f"({fx.name}-mstar {fx.api_version}.0, plugin API {fx.api_version})" in out, out[:300]
    checked = set(re.findall(r"^(\w+) +\w+ +\w+ +\S+ +pass\b", out, re.M))
    assert checked == {"paged_prefill", "paged_decode", "mixed", "prefixed_ragged"}, checked
    counts = re.search(r"(\d+) of (\d+) cases passed", out)
    assert counts and counts[1] == counts[2] and int(counts[1]) > 400, out[-2000:]
    # every declared feature was asked, and multi-token rows ran on the wrapper its version names
    for marker in ("fp8_e4m3", "fp8_e5m2", "-cap2", "-sinks", "layer_windows"):
        assert marker in out, marker
    ran_multi = set(re.findall(r"^(\w+) .* multi_token-", out, re.M))
    assert ran_multi == set(fx.multi_token_wrappers), ran_multi


# A demo per workload, in one process: the paged path (text) and the dense path (denoise).
DEMOS = ("import sys\nfrom mstar_core.cli import main\n"
         "sys.exit(max(main(['demo', '--threads', '1', *a.split()]) for a in sys.argv[1:]))")
REFERENCE_CONFIG = '[attention]\nbackend = "reference"\n'
# path -> (config file or None, extra demo arguments, env, the paged line's backend); NAME: the fixture's
PATHS = {
    "backend-flag": (REFERENCE_CONFIG, "--backend NAME", {}, "NAME"),  # --backend wins over the config
    "config-name": ('[attention]\nbackend = "NAME"\n', "", {}, "NAME"),
    "config-table": ('[attention.backend]\npaged_prefill = "reference"\npaged_decode = "NAME"\nmixed = "NAME"\n'
                     'prefixed_ragged = "NAME"\n', "", {}, "reference+NAME"),
    "env": (REFERENCE_CONFIG, "", {"MSTAR_ATTENTION_BACKEND": "NAME"}, "NAME"),  # the env wins over the config
    "auto": (None, "", {}, "NAME"),  # priority 10: before the reference
}


@BY_VERSION
@pytest.mark.parametrize("path", PATHS)
def test_demos_select_and_run_it(sites, fx, path, tmp_path):
    config, extra, env, paged = (x.replace("NAME", fx.name) if isinstance(x, str) else x for x in PATHS[path])
    env = {k: v.replace("NAME", fx.name) for k, v in env.items()}
    if config is not None:
        (tmp_path / "mstar.toml").write_text(config)
        extra += " --config mstar.toml"
    r = _run(sites(fx), ["-c", DEMOS, extra, f"--workload denoise {extra}"], tmp_path, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert f"backend: {paged}" in lines, r.stdout
    assert f"backend: {fx.name} (PrefixedPrefillWrapper)" in lines, r.stdout
    assert r.stdout.count("OK") == 2, r.stdout


@BY_VERSION
def test_paged_manager_serves_every_feature(sites, fx):
    r = _run(sites(fx), [str(HERE / "paged_features_run.py"), fx.name], sites(fx).parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": OK") == 4, r.stdout


@BY_VERSION
def test_mstar_check_catches_a_planted_bug(sites, fx, tmp_path):
    site = shutil.copytree(sites(fx), tmp_path / "site")
    wrappers = site / f"{fx.name}_mstar" / "wrappers.py"
    text, (line, wrong) = wrappers.read_text(), fx.planted
    assert text.count(line) == 1, f"the planted line is not once in {wrappers.name}: {line!r}"
    wrappers.write_text(text.replace(line, wrong))
    r = _check(site, fx.name, "--quick")  # a few cases of each feature suffice to catch it
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"\d+ failed, by rule: oracle \(\d+\)$", r.stdout.rstrip()), r.stdout[-2000:]
    failing = re.findall(r"^FAIL \S+ \S+ (\S+ \S+) \[oracle\]", r.stdout, re.M)
    assert failing and all(re.search(fx.planted_cases, case) for case in failing), failing
