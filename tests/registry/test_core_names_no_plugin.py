"""The core ranks backends by what they declare (``priority``, measured tables), never by name:
no registry module names an in-repo plugin's backend, and renaming those backends leaves auto's
order as it was."""

from __future__ import annotations

import ast
import re
from dataclasses import replace

from mstar_core import Registry
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.registry import DEVICE_KINDS, auto_order
from mstar_fa3.plugin import FA3
from mstar_flashinfer.plugin import FLASHINFER
from mstar_rocm.plugin import AITER

from ..helpers import REPO

PLUGIN_BACKENDS = (FLASHINFER, FA3, AITER)
# The backends' names and the kernel library AITER is named for, as words ("dense_or_flashinfer",
# the seed function's name, is one word of its own).
NAMED = re.compile(r"\b(" + "|".join([*(s.name for s in PLUGIN_BACKENDS), "aiter"]) + r")\b")
REGISTRY = REPO / "mstar_core" / "registry"
# discovery.FIRST_PARTY: the install line for a first-party name no installed plugin registers.
INSTALL_HINTS = ("discovery.py", "FIRST_PARTY")


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _install_hints(path, tree: ast.AST) -> set[int]:
    if path.name != INSTALL_HINTS[0]:
        return set()
    return {id(c) for n in ast.walk(tree) if isinstance(n, ast.AnnAssign | ast.Assign)
            and INSTALL_HINTS[1] in ast.unparse(n.target if isinstance(n, ast.AnnAssign) else n.targets[0])
            for c in ast.walk(n)}


def names_in_code(path) -> list[str]:
    """``line: text`` of every identifier and string (docstrings, device kinds and the install
    hints aside) in ``path`` that names an in-repo plugin backend."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree) | _install_hints(path, tree)
    hits = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value not in DEVICE_KINDS:
            text = n.value
        elif isinstance(n, ast.Name | ast.Attribute | ast.FunctionDef | ast.ClassDef | ast.arg | ast.alias):
            text = getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "name", None) or n.arg
        else:
            continue
        if NAMED.search(text):
            hits.append(f"{n.lineno}: {text!r}")
    return hits


def test_the_check_finds_a_plugin_name_and_passes_the_seed_function(tmp_path):
    code = tmp_path / "order.py"
    code.write_text('"""fa3 first (a docstring)."""\nORDER = ("fa3", "reference")\ndense_or_flashinfer = 1\n'
                    'KIND = "rocm"\n')
    assert names_in_code(code) == ["2: 'fa3'"]


def test_no_registry_module_names_an_in_repo_plugin_backend():
    modules = sorted(REGISTRY.glob("*.py"))
    assert {"selection.py", "registry.py", "spec.py", "measured.py", "dense.py"} <= {p.name for p in modules}
    found = {p.name: hits for p in modules if (hits := names_in_code(p))}
    assert not found, f"auto's order must come from the backends' declarations, not their names: {found}"


def test_auto_order_is_the_same_under_other_names():
    def registry(rename: dict[str, str]) -> Registry:
        reg = Registry(discover=False)
        reg.register(REFERENCE, distribution="mstar-core")
        for spec in PLUGIN_BACKENDS:
            reg.register(replace(spec, name=rename.get(spec.name, spec.name)))
        return reg

    rename = {"flashinfer": "zeta", "fa3": "alpha", "rocm": "mu"}
    for caps in (("paged_decode",), ("paged_prefill", "paged_decode", "mixed"), ("prefixed_ragged",)):
        assert auto_order(caps, registry(rename)) == [rename.get(n, n) for n in auto_order(caps, registry({}))]
