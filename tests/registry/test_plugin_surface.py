"""``mstar_core.plugin`` is the whole surface a backend imports: the in-repo backends, the example
distribution of docs/PLUGINS.md and the ``mstar new-backend`` skeleton import nothing else of
mstar's (test code may also import ``mstar_core.testing``), and every import path PLUGINS.md
shows in code resolves."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys

import mstar_core.plugin
from mstar_core.scaffold import CAPABILITY_CHOICES, files_for

from ..helpers import REPO

PACKAGES = ("mstar_flashinfer", "mstar_fa3", "mstar_rocm")
DOC = REPO / "docs" / "PLUGINS.md"
TEST_KIT = "mstar_core.testing"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_DOC_FILE = re.compile(r"<!-- file: (\S+) -->\n```python\n(.*?)^```", re.M | re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"\bmstar_core(?:\.\w+)*")
_FROM_IMPORT = re.compile(r"^[ \t]*from (mstar_core[\w.]*) import (?:\(([^)]*)\)|([^\n]*))", re.M)


def is_test_code(path: str) -> bool:
    return path.startswith("tests/") or "/tests/" in path


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import; ``from a import b`` counts as ``a.b``, so that
    ``from mstar_core import plugin`` is the module and ``from mstar_core import X`` a name of the top level."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def allowed(name: str, test_code: bool) -> bool:
    if not (name == "mstar_core" or name.startswith("mstar_core.")):
        return True
    prefixes = ("mstar_core.plugin", TEST_KIT) if test_code else ("mstar_core.plugin",)
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(where: str, source: str) -> list[str]:
    """``where:line: name`` for each import of mstar outside the plugin surface."""
    tree = ast.parse(source, filename=where)
    return [f"{where}:{line}: imports {name}" for line, name in imported_modules(tree)
            if not allowed(name, is_test_code(where))]


def sources() -> dict[str, str]:
    """Every Python source a backend author reads as an example: display path -> text."""
    found = {str(p.relative_to(REPO)): p.read_text() for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}
    found |= {f"docs/PLUGINS.md ({rel})": text for rel, text in _DOC_FILE.findall(DOC.read_text())}
    found |= {f"mstar new-backend ({rel})": text for rel, text in files_for("demo", CAPABILITY_CHOICES).items()
              if rel.endswith(".py")}
    return found


def test_the_checker_flags_every_path_but_the_surface():
    src = """
import torch
import mstar_core
import mstar_core.testing.check
from mstar_core import BackendSpec
from mstar_core import plugin
from mstar_core.errors import InputError
from mstar_core.plugin import InputError
from mstar_core.testing import conformance
from . import sibling
"""
    assert violations("pkg/mod.py", src) == [
        "pkg/mod.py:3: imports mstar_core", "pkg/mod.py:4: imports mstar_core.testing.check",
        "pkg/mod.py:5: imports mstar_core.BackendSpec", "pkg/mod.py:7: imports mstar_core.errors.InputError",
        "pkg/mod.py:9: imports mstar_core.testing.conformance"]
    assert violations("pkg/tests/test_mod.py", src) == [
        "pkg/tests/test_mod.py:3: imports mstar_core", "pkg/tests/test_mod.py:5: imports mstar_core.BackendSpec",
        "pkg/tests/test_mod.py:7: imports mstar_core.errors.InputError"]


def test_every_source_is_read():
    found = sources()
    for pkg in PACKAGES:
        assert f"{pkg}/plugin.py" in found, pkg
    assert {"docs/PLUGINS.md (plainattn_mstar/plugin.py)", "docs/PLUGINS.md (tests/test_conformance.py)",
            "mstar new-backend (tests/test_conformance.py)"} <= set(found), sorted(found)
    assert {f"mstar new-backend (demo_mstar/{c}.py)" for c in CAPABILITY_CHOICES} <= set(found), sorted(found)


def test_backends_import_mstar_only_through_the_plugin_surface():
    bad = [v for where, text in sources().items() for v in violations(where, text)]
    assert not bad, "import these from mstar_core.plugin (tests may use mstar_core.testing):\n" + "\n".join(bad)


def test_the_surface_lists_each_name_once_and_every_name_resolves():
    names = mstar_core.plugin.__all__
    assert len(names) == len(set(names))
    assert [n for n in names if getattr(mstar_core.plugin, n, None) is None] == []


def test_importing_the_surface_leaves_the_test_kit_unloaded():
    # discovery imports every plugin's entry module: the case tables load only when a test asks
    code = ("import sys, mstar_core.plugin; "
            f"print(sorted(m for m in sys.modules if m.startswith({TEST_KIT!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def code_spans(markdown: str) -> list[str]:
    """The fenced Python blocks and the inline code spans outside any fence."""
    blocks = [body for lang, body in _FENCE.findall(markdown) if lang in ("python", "")]
    return blocks + _INLINE.findall(_FENCE.sub("", markdown))


def resolves(dotted: str) -> bool:
    """Is ``dotted`` a module, or a module's attribute chain?"""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def documented_paths(markdown: str) -> list[str]:
    """Every ``mstar_core...`` path the code shows, with ``from X import a, b`` as ``X.a``, ``X.b``."""
    paths = []
    for span in code_spans(markdown):
        for module, grouped, line in _FROM_IMPORT.findall(span):
            text = re.sub(r"#[^\n]*", "", grouped or line)
            paths += [f"{module}.{item.split()[0]}" for item in text.split(",") if item.strip()]
        paths += _DOTTED.findall(_FROM_IMPORT.sub("", span))
    return paths


def test_the_path_reader_finds_imports_and_dotted_names():
    doc = """Prose naming mstar_core.not_in_code, and `mstar_core.plugin.CAPABILITIES` inline.

```python
from mstar_core.plugin import BackendSpec, hookimpl as h  # a comment
from mstar_core.plugin import (
    InputError,  # why
)
x = mstar_core.select_backend(...)
```
"""
    assert documented_paths(doc) == ["mstar_core.plugin.BackendSpec", "mstar_core.plugin.hookimpl",
                                     "mstar_core.plugin.InputError", "mstar_core.select_backend",
                                     "mstar_core.plugin.CAPABILITIES"]
    assert resolves("mstar_core.plugin.BackendSpec") and resolves("mstar_core.select_backend")
    assert not resolves("mstar_core.plugin.NoSuchName") and not resolves("mstar_core.no_such_module.x")


def test_every_path_plugins_md_shows_resolves():
    paths = documented_paths(DOC.read_text())
    assert "mstar_core.plugin.BackendSpec" in paths and "mstar_core.plugin.conformance_test" in paths
    assert sorted({p for p in paths if not resolves(p)}) == []


def test_every_name_plugins_md_imports_from_the_surface_is_listed_in_it():
    prefix = "mstar_core.plugin."
    names = {p[len(prefix):].split(".")[0] for p in documented_paths(DOC.read_text()) if p.startswith(prefix)}
    assert sorted(names - set(mstar_core.plugin.__all__)) == []


def test_the_example_distribution_declares_the_current_api_version():
    plugin = dict(_DOC_FILE.findall(DOC.read_text()))["plainattn_mstar/plugin.py"]
    assert re.findall(r'api_version="([^"]*)"', plugin) == [mstar_core.plugin.API_VERSION]
