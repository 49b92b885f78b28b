"""docs/ARCHITECTURE.md's "From Python" states how code selects a backend: ``select_backend``'s
parameters and defaults as the code has them, and every spec key the managers' ``build`` reads."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch

from mstar_core import DenseAttentionManager, PagedAttentionManager, select_backend

ROOT = Path(__file__).resolve().parents[2]


def section(doc: str, heading: str) -> str:
    """The text under ``heading``, up to the next heading of its level or above."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    level = len(heading) - len(heading.lstrip("#"))
    end = re.compile(rf"\n#{{1,{level}}} ").search(text, start + 1)
    return text[start:end.start() if end else len(text)]


def flat(text: str) -> str:
    """``text`` with its line breaks and indents as single blanks (prose wraps anywhere)."""
    return " ".join(text.split())


def test_the_documented_select_backend_call_is_its_signature():
    from_python = section("docs/ARCHITECTURE.md", "### From Python")
    (block,) = re.findall(r"```python\n(.*?)```", from_python, re.S)
    call = ast.parse(textwrap.dedent(block)).body[0].value
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == "select_backend"
    documented = {k.arg: eval(ast.unparse(k.value), {"torch": torch}) for k in call.keywords}
    params = inspect.signature(select_backend).parameters
    assert list(documented) == list(params)
    assert documented == {name: p.default for name, p in params.items()}
    for name in params:  # and each is explained
        assert f"`{name}`" in from_python or f"`{name}=" in from_python, name


def spec_keys(build) -> set[str]:
    """The keys ``build`` reads from its spec: ``spec.get("k", ...)``, ``spec["k"]``, and the
    names of a ``keys = (...)`` tuple it reads them through."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(build)))
    keys = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and ast.unparse(node.func.value) == "spec"):
            keys.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "spec" \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        elif isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["keys"]:
            keys |= {e.value for e in node.value.elts}
    return keys


@pytest.mark.parametrize("manager, expected", [
    (PagedAttentionManager, {"kv", "backend", "config", "max_batch_size", "max_total_tokens", "max_prefill_rows",
                             "slots", "accelerator_graph"}),
    (DenseAttentionManager, {"kv", "backend", "config", "wrapper_class", "flashinfer_backend", "max_cached_tokens"}),
])
def test_the_docs_name_every_spec_key_a_managers_build_reads(manager, expected):
    assert spec_keys(manager.build) == expected
    from_python = section("docs/ARCHITECTURE.md", "### From Python")
    part = from_python[from_python.index(f"`{manager.__name__}.build`"):]
    part = part[:part.index("\n  - ", 1)] if manager is PagedAttentionManager else part[:part.index("\n- ", 1)]
    for key in expected:
        assert f'`"{key}"`' in part, (manager.__name__, key)


def test_plugins_md_says_where_code_selects():
    chosen = flat(section("docs/PLUGINS.md", "## 6. How a backend is chosen"))
    for name in ("select_backend", "PagedAttentionManager.build", "DenseAttentionManager.build",
                 'spec["backend"]', "ARCHITECTURE.md#from-python"):
        assert name in chosen, name


def test_plugins_md_states_the_wrapper_rules_in_one_place():
    rules = flat(section("docs/PLUGINS.md", "### 4.7 The rules in one place"))
    for phrase in ("The plan's `dtype` is q's dtype", "the output is in q's dtype",
                   "`sm_scale`, `k_scale`, `v_scale` and `logits_soft_cap`", "Python floats",
                   "never returns a view of memory that a later run", "strided views whose last dimension",
                   "`layer_view(i)`", "never writes into its inputs", "bit-identical", "FP8 KV",
                   "per path", "`prefixed_ragged` wrappers never get it", "no wrapper protocol yet"):
        assert phrase in rules, phrase


def test_plugins_md_says_what_a_malformed_api_version_costs_as_the_registry_says_it():
    from mstar_core.registry.discovery import PluginFailure

    versions = flat(section("docs/PLUGINS.md", "## 2. The plugin API version"))
    assert "**Malformed:**" in versions and "the whole hook fails" in versions
    assert "None of the plugin's backends is registered, the valid ones included" in versions
    for stage in ("load", "register"):
        assert f'"{PluginFailure("ep", "dist", "1.0", stage, "error").outcome}"' in versions
