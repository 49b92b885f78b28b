"""The skeleton ``mstar new-backend`` writes: a wrapper for each capability asked (prefixed_ragged
alone by default), each alone and all together passing ``mstar check`` as generated; a spec of
the current plugin API providing exactly those; code importing nothing of mstar's but
``mstar_core.plugin``; ruff and mypy clean under the lint and type configuration it carries; and
every error path its wrappers write raising mstar's own error."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from mstar_core import InputError, Registry, StateError, Unsupported
from mstar_core.cli import main
from mstar_core.plugin import (
    API_VERSION,
    PREFIXED_RAGGED,
    MixedWrapper,
    PagedDecodeWrapper,
    PagedPrefillWrapper,
    PrefixedPrefillWrapper,
    WrapperSize,
    paged_plan,
    ragged_plan,
)
from mstar_core.scaffold import CAPABILITY_CHOICES, files_for, wrapper_class, write_skeleton
from mstar_core.testing.check import check_backend

from .helpers import REPO

# mstar_core as mypy reads an installed package: followed, its own findings left to mstar's gate.
# (An editable install reaches Python through an import hook mypy cannot follow, so MYPYPATH
# names the clone instead.)
INSTALLED_CORE = '''
[[tool.mypy.overrides]]
module = ["mstar_core", "mstar_core.*"]
follow_imports = "silent"
'''
PROTOCOLS = {"paged_prefill": PagedPrefillWrapper, "paged_decode": PagedDecodeWrapper, "mixed": MixedWrapper,
             "prefixed_ragged": PrefixedPrefillWrapper}


@pytest.fixture
def skeleton(tmp_path: Path) -> Path:
    root = tmp_path / "tpk"
    write_skeleton("tpk", root)
    return root


@pytest.fixture
def every_capability(tmp_path: Path) -> Path:
    root = tmp_path / "tpk"
    write_skeleton("tpk", root, CAPABILITY_CHOICES)
    return root


@pytest.fixture
def generated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ModuleType]]:
    """``generated(name, capabilities)``: write that skeleton and import its package's entry
    module from the folder written (each test's package names its own, so none is cached)."""
    packages: list[str] = []

    def make(name: str, capabilities: Sequence[str] | None = None) -> ModuleType:
        root = tmp_path / name
        write_skeleton(name, root, capabilities)
        monkeypatch.syspath_prepend(str(root))
        packages.append(f"{name}_mstar")
        return importlib.import_module(f"{name}_mstar.plugin")

    yield make
    for module in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[module]


def _needs(tool: str) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (the test extra brings it)")


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


def _check_quick(module: ModuleType) -> str:
    """``mstar check --quick`` on the spec ``module`` registers, in this process: the failures
    rendered ("" when it passes)."""
    registry = Registry(discover=False)
    registry.register(module.SPEC, distribution=f"{module.SPEC.name}-mstar", version="0.1.0")
    report = check_backend(module.SPEC.name, device="cpu", registry=registry, quick=True)
    assert {r.capability for r in report.results} == set(module.SPEC.provides)
    return "" if report.ok else report.render(all_rows=False)


# -- the capabilities it writes ------------------------------------------------------------------

@pytest.mark.parametrize("capability", CAPABILITY_CHOICES)
def test_each_capability_alone_passes_mstar_check_as_generated(generated, capability):
    plugin = generated(f"tpk_{capability}", [capability])
    assert plugin.SPEC.api_version == API_VERSION
    assert plugin.SPEC.provides == {capability: f"tpk_{capability}_mstar.{capability}:{wrapper_class(capability)}"}
    assert _check_quick(plugin) == ""


def test_several_capabilities_together_pass_mstar_check_as_generated(generated):
    plugin = generated("tpk_all", ["prefixed_ragged", "mixed", "paged_decode", "paged_prefill", "mixed"])
    assert plugin.SPEC.api_version == API_VERSION
    assert list(plugin.SPEC.provides) == list(CAPABILITY_CHOICES)  # the core's order, each once
    assert _check_quick(plugin) == ""


def test_by_default_the_skeleton_provides_prefixed_ragged_alone(generated, tmp_path, capsys):
    assert generated("tpk_default").SPEC.provides == {PREFIXED_RAGGED: "tpk_default_mstar.prefixed_ragged:"
                                                                       "PrefixedPrefillWrapper"}
    assert main(["new-backend", "tpk", str(tmp_path / "cli")]) == 0
    assert "(prefixed_ragged)" in capsys.readouterr().out
    written = {p.relative_to(tmp_path / "cli").as_posix() for p in (tmp_path / "cli").rglob("*.py")}
    assert {p for p in written if p.startswith("tpk_mstar/")} == {
        "tpk_mstar/__init__.py", "tpk_mstar/plugin.py", "tpk_mstar/probe.py", "tpk_mstar/attend.py",
        "tpk_mstar/prefixed_ragged.py"}
    # --help says so before anything else it describes
    with pytest.raises(SystemExit):
        main(["new-backend", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "By default it provides prefixed_ragged alone" in help_text
    assert "--capability CAP, repeated, writes a wrapper for each capability named instead" in help_text


def test_an_unknown_capability_is_refused_naming_the_supported_ones(tmp_path, capsys):
    supported = ", ".join(CAPABILITY_CHOICES)
    with pytest.raises(SystemExit) as exit_:
        main(["new-backend", "tpk", str(tmp_path / "d"), "--capability", "mixed", "--capability", "bounded"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bounded'" in err and all(f"'{c}'" in err for c in CAPABILITY_CHOICES)
    with pytest.raises(InputError, match=f"unknown capability 'bounded', 'dense'; the supported ones are {supported}"):
        write_skeleton("tpk", tmp_path / "d", ["bounded", "mixed", "dense"])
    with pytest.raises(InputError, match=r"got the string 'mixed' \(write \['mixed'\]\)"):
        files_for("tpk", "mixed")
    assert not (tmp_path / "d").exists()


def _imports(source: str) -> list[str]:
    tree = ast.parse(source)
    found = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    return found + [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]


def test_the_generated_code_imports_only_the_plugin_surface_torch_and_the_stdlib():
    for rel, text in files_for("tpk", CAPABILITY_CHOICES).items():
        if rel.endswith(".py"):
            outside = [m for m in _imports(text) if m != "mstar_core.plugin" and m.split(".")[0] not in
                       {"torch", "tpk_mstar", *sys.stdlib_module_names}]
            assert outside == [], f"{rel} imports {outside}"


@pytest.fixture
def wrappers(every_capability: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, type]]:
    """Capability -> the wrapper class the skeleton of every capability holds for it."""
    monkeypatch.syspath_prepend(str(every_capability))
    yield {c: getattr(importlib.import_module(f"tpk_mstar.{c}"), wrapper_class(c)) for c in CAPABILITY_CHOICES}
    for module in [m for m in sys.modules if m.split(".")[0] == "tpk_mstar"]:
        del sys.modules[module]


def test_each_wrapper_has_its_protocols_signatures(wrappers):
    for capability, protocol in PROTOCOLS.items():
        for method in ("from_size", "plan", "run"):
            mine, theirs = (inspect.signature(getattr(c, method)).parameters.values()
                            for c in (wrappers[capability], protocol))
            assert [(p.name, p.kind, p.default) for p in mine] == [(p.name, p.kind, p.default) for p in theirs], \
                f"{wrappers[capability].__name__}.{method}"


# -- lint, types, error paths ------------------------------------------------------------------

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


def test_the_skeleton_passes_ruff_under_its_own_config(every_capability):
    _needs("ruff")
    assert "[tool.ruff.lint]" in (every_capability / "pyproject.toml").read_text()
    r = _run(["ruff", "check", "--no-cache", "."], every_capability)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "All checks passed" in r.stdout


@pytest.mark.slow
def test_the_skeleton_passes_mypy_under_its_own_config(every_capability, tmp_path):
    _needs("mypy")
    with open(every_capability / "pyproject.toml", "a") as f:
        f.write(INSTALLED_CORE)
    cache = tmp_path / "mypy-cache"
    if (REPO / ".mypy_cache").is_dir():  # torch's analysis from mstar's own mypy run: a minute saved
        shutil.copytree(REPO / ".mypy_cache", cache)
    r = _run(["mypy", "--cache-dir", str(cache)], every_capability, MYPYPATH=str(REPO))
    assert r.returncode == 0, r.stdout + r.stderr
    sources = len(list(every_capability.rglob("*.py")))
    assert f"Success: no issues found in {sources} source files" in r.stdout


def test_every_error_path_of_the_skeleton_wrappers_raises_mstar_errors(wrappers):
    one = torch.tensor([0, 1], dtype=torch.int32)
    q, k, v = torch.randn(2, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ragged = ragged_plan(torch.tensor([0, 2]), torch.tensor([0, 3]), 2, 3, torch.float32)
    w = wrappers["prefixed_ragged"].from_size(WrapperSize(4, 2, 8, torch.device("cpu")))
    with pytest.raises(StateError, match="run before plan"):
        w.run(q, k, v)
    with pytest.raises(InputError, match="PrefixedPrefillWrapper.plan takes a RaggedPlan, got PagedPlan"):
        w.plan(paged_plan("paged_prefill", one, one, one[:1], one[1:], 1, torch.float32))
    with pytest.raises(Unsupported, match="PrefixedPrefillWrapper.plan: logits_soft_cap not implemented"):
        w.plan(ragged_plan(torch.tensor([0, 2]), torch.tensor([0, 3]), 2, 3, torch.float32, logits_soft_cap=5.0))
    # a good plan after the refused ones runs: the last query sees every key, the first query all
    # but the last (causal, aligned bottom-right)
    w.plan(ragged)
    with pytest.raises(Unsupported, match="PrefixedPrefillWrapper.run: sinks not implemented"):
        w.run(q, k, v, sinks=torch.zeros(4))
    out = w.run(q, k, v)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    for i, seen in ((0, 2), (1, 3)):
        p = torch.softmax(torch.einsum("hd,khd->hk", q[i], kk[:seen]) / 8**0.5, dim=-1)
        torch.testing.assert_close(out[i], torch.einsum("hk,khd->hd", p, vv[:seen]))

    layer = torch.randn(1, 2, 1, 2, 8)
    for capability, other in (("paged_prefill", "mixed"), ("paged_decode", "mixed"), ("mixed", "paged_prefill")):
        w = wrappers[capability].from_size(WrapperSize(4, 2, 8, torch.device("cpu"), page_size=1))
        name = wrappers[capability].__name__
        with pytest.raises(StateError, match=f"{name}.run before plan"):
            w.run(q[:1], layer)
        with pytest.raises(InputError, match=f"{name}.plan takes a {capability} PagedPlan, got a {other} PagedPlan"):
            w.plan(paged_plan(other, one, one, one[:1], one[1:], 1, torch.float32))
        with pytest.raises(InputError, match=f"{name}.plan takes a {capability} PagedPlan, got RaggedPlan"):
            w.plan(ragged)
        with pytest.raises(Unsupported, match=f"{name}.plan: kv_data_type, sink_logits not implemented"):
            w.plan(paged_plan(capability, one, one, one[:1], one[1:], 1, torch.float32,
                              kv_data_type=torch.float8_e4m3fn, sink_logits=True))
        w.plan(paged_plan(capability, one, one, one[:1], one[1:], 1, torch.float32))
        with pytest.raises(Unsupported, match=f"{name}.run: k_scale, v_scale not implemented"):
            w.run(q[:1], layer, k_scale=0.5, v_scale=2.0)
        # one query over one key: its value, in every head reading that KV head
        torch.testing.assert_close(w.run(q[:1], layer), layer[0, 1, 0].repeat_interleave(2, dim=0)[None])
