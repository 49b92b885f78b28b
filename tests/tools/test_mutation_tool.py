"""tools/mutation.py's slips and map: each operator plants what it says, text that only speaks is
left alone, and every module, test path and equivalent the map names exists."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


mutants = _load("mutants")

SOURCE = '''
"""Docstring 1 < 2."""
import logging
log = logging.getLogger(__name__)
LIMIT = 8
TOLERANCE = {"f32": 2e-5}


class Pages:
    def __init__(self) -> None:
        self.refs = [0] * LIMIT
        self.version = 0

    def take(self, page: int, force: bool = False) -> int:
        """Takes a page."""
        if page < 0 or page >= LIMIT:
            raise ValueError(f"page {page + 1} outside 0..{LIMIT - 1}")
        log.debug("took %d", page + 1)
        self.refs[page] += 1
        self.version += 1
        self.forget(page)
        return all(r > 0 for r in self.refs) and not force

    def forget(self, page: int) -> None:
        shape = (page, 4)
        torch_like(page, 16, size=32)
'''


def _slips() -> set[tuple[str, str, str]]:
    return {(m.operator, m.before, m.after) for m in mutants.mutants("pages.py", SOURCE)}


def test_each_operator_plants_its_slip() -> None:
    slips = _slips()
    expected = {
        ("compare", "page < 0", "(page <= 0)"),
        ("compare", "page >= LIMIT", "(page > LIMIT)"),
        ("boolean", "page < 0 or page >= LIMIT", "(page < 0 and page >= LIMIT)"),
        ("condition", "page < 0 or page >= LIMIT", "(page >= LIMIT)"),
        ("drop", 'raise ValueError(f"page {page + 1} outside 0..{LIMIT - 1}")', "pass"),
        ("drop", "self.refs[page] += 1", "pass"),
        ("augassign", "self.version += 1", "self.version -= 1"),
        ("drop", "self.forget(page)", "pass"),
        ("call", "all", "any"),
        ("not", "not force", "(force)"),
        ("number", "8", "(9)"),
        ("number", "2e-5", "(4e-05)"),
        ("bool", "False", "True"),
        ("arith", "[0] * LIMIT", "([0] / LIMIT)"),
    }
    assert expected <= slips, sorted(expected - slips)


def test_text_that_only_speaks_and_data_in_calls_are_left_alone() -> None:
    slips = _slips()
    befores = {b for _, b, _ in slips}
    # the docstring's comparison, the message's arithmetic, the log call, an annotation
    assert not any("Docstring" in b or "took" in b or "outside" in b and "raise" not in b for b in befores)
    assert ("arith", "page + 1", "(page - 1)") not in slips
    assert ("arith", "LIMIT - 1", "(LIMIT + 1)") not in slips
    # a call's numeric arguments and a tuple's numbers inside a function are a case's data
    assert not {("number", "16", "(17)"), ("number", "32", "(33)"), ("number", "4", "(5)")} & slips


def test_a_line_marked_no_mutate_plants_nothing() -> None:
    marked = SOURCE.replace("self.version += 1", "self.version += 1  # pragma: no mutate")
    befores = {(m.operator, m.before) for m in mutants.mutants("pages.py", marked)}
    assert ("augassign", "self.version += 1") not in befores
    assert ("drop", "self.refs[page] += 1") in befores


def test_keys_are_unique_and_every_mutant_compiles() -> None:
    planted = list(mutants.mutants("pages.py", SOURCE))
    assert len({m.key for m in planted}) == len(planted)
    for m in planted:
        compile(m.source, "pages.py", "exec")
        assert m.source != SOURCE


def test_the_map_names_modules_and_tests_that_exist_and_equivalents_that_are_planted() -> None:
    config = tomllib.loads((ROOT / "tools" / "mutation.toml").read_text())
    assert config["modules"]
    for module, entry in config["modules"].items():
        assert (ROOT / module).is_file(), module
        assert set(entry) <= {"tests", "equivalent"}, module
        for test in entry["tests"]:
            assert (ROOT / test).exists(), f"{module}: {test}"
        if not entry.get("equivalent"):
            continue
        keys = {m.key for m in mutants.mutants(module, (ROOT / module).read_text())}
        for eq in entry["equivalent"]:
            assert eq["why"].strip(), f"{module}: {eq['key']} says not why it is equivalent"
            assert eq["key"] in keys, f"{module}: equivalent {eq['key']!r} is no longer planted"


mutation = _load("mutation")


def _outcome(key: str, result: str):
    slip = next(m for m in mutants.mutants("pages.py", SOURCE) if m.key == key)
    return mutation.Outcome(slip, result, 1.5, 3, "")


def test_a_journal_keeps_each_outcome_and_resumes_only_on_the_same_text(tmp_path: Path) -> None:
    keys = [m.key for m in mutants.mutants("pages.py", SOURCE)][:3]
    journal = mutation.Journal(tmp_path / "pages.journal.jsonl", SOURCE, "abc1234")
    assert journal.load() == (None, {})
    journal.start({}, "abc1234")
    journal.add(_outcome(keys[0], "caught"))
    journal.add(_outcome(keys[1], "survived"))
    with journal.path.open("a") as f:
        f.write('{"key": "half-writ')  # a run killed mid-line
    again = mutation.Journal(journal.path, SOURCE, "def5678")
    commit, done = again.load()
    assert commit == "abc1234"
    assert {k: r["result"] for k, r in done.items()} == {keys[0]: "caught", keys[1]: "survived"}
    again.start(done, commit)  # rewritten whole: the half line is gone, the outcomes stay
    assert again.load() == (commit, done)
    other = mutation.Journal(journal.path, SOURCE + "\n# changed\n", "def5678")
    try:
        other.load()
    except SystemExit as e:
        assert "another text" in str(e)
    else:
        raise AssertionError("a journal of another module text was resumed")


def test_the_traced_run_is_dealt_by_file_largest_first(tmp_path: Path) -> None:
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests" / "a" / "test_big.py").write_text("x = 1\n" * 50)
    (tmp_path / "tests" / "a" / "test_small.py").write_text("x = 1\n")
    (tmp_path / "tests" / "a" / "helpers.py").write_text("x = 1\n" * 99)
    (tmp_path / "tests" / "test_mid.py").write_text("x = 1\n" * 9)
    files = mutation._test_files(["tests/a", "tests/test_mid.py", "tests/a/test_big.py"], tmp_path)
    assert [f.name for f in files] == ["test_big.py", "test_mid.py", "test_small.py"]
