"""The fixtures under tests/compat/fixtures are plugins as their authors wrote them for one plugin
API version each; they hold the compatibility promise only while nobody edits them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"
TABLE = HERE / "frozen_fixtures.json"


def fixture_hashes() -> dict[str, str]:
    """Every fixture file (relative to fixtures/) -> the sha256 of its bytes; caches left out."""
    return {p.relative_to(FIXTURES).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(FIXTURES.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")}


def test_fixtures_are_frozen():
    pinned, actual = json.loads(TABLE.read_text()), fixture_hashes()
    changed = sorted(f for f in pinned.keys() & actual.keys() if pinned[f] != actual[f])
    added, removed = sorted(actual.keys() - pinned.keys()), sorted(pinned.keys() - actual.keys())
    assert not (changed or added or removed), (
        "tests/compat/fixtures are frozen: each is a plugin written for one plugin API version, and the "
        "core must run it unchanged, so a failure it shows is fixed in the core, never in the fixture. A new "
        "contract version gets a new fixture folder (and its hashes in tests/compat/frozen_fixtures.json); "
        f"the existing ones stay as they are. changed: {changed}; not pinned: {added}; missing: {removed}")
