"""The public API is ``mstar_core.__all__``: every name in it resolves from ``mstar_core``, and
every name the README and docs/PLUGINS.md import from ``mstar_core`` is in it."""

from __future__ import annotations

import re

import pytest

import mstar_core

from .helpers import REPO

DOCS = ("README.md", "docs/PLUGINS.md")
# The names that load the transformers integration on first use (the `transformers` extra).
NEEDS_TRANSFORMERS = {"Engine", "EngineOptions", "Generation", "generate", "generate_report", "probe"}

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_IMPORT = re.compile(r"^[ \t]*from mstar_core import (?:\(([^)]*)\)|([^\n]*))", re.M)


def imported_from_mstar_core(markdown: str) -> list[str]:
    """The names every ``from mstar_core import ...`` line of the fenced code blocks imports (the
    name itself, not its ``as`` alias), in order."""
    names = []
    for block in _FENCE.findall(markdown):
        for grouped, line in _IMPORT.findall(block):
            text = grouped or line.split("#", 1)[0].rstrip("\\")
            for item in re.sub(r"#[^\n]*", "", text).split(","):
                if item.strip():
                    names.append(item.split()[0])
    return names


def test_the_parser_reads_plain_grouped_and_aliased_imports():
    doc = """Text with from mstar_core import NotInCode outside a block.

```python
from mstar_core import KVManager, Node as N  # a comment
from mstar_core import (
    Step,  # why
    StepContext,
)
from mstar_core.kv import KVConfig
    from mstar_core import warmup
```
"""
    assert imported_from_mstar_core(doc) == ["KVManager", "Node", "Step", "StepContext", "warmup"]


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.requires_transformers] if name in NEEDS_TRANSFORMERS else [])
    for name in sorted(mstar_core.__all__)])
def test_every_public_name_resolves(name):
    assert getattr(mstar_core, name) is not None


def test_the_public_names_are_listed_once():
    assert len(mstar_core.__all__) == len(set(mstar_core.__all__))


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_the_docs_import_from_mstar_core_is_public(doc):
    names = imported_from_mstar_core((REPO / doc).read_text())
    missing = sorted(set(names) - set(mstar_core.__all__))
    assert not missing, f"{doc} imports {missing} from mstar_core, but mstar_core.__all__ does not list them"
