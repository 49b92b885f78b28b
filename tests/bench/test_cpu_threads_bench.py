"""bench/cpu_threads.py on CPU: its busy process ends whatever happens, and the smoke run writes
every figure and target (the figures themselves are the full run's, on a quiet machine)."""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


# the script builds a transformers model
pytestmark = pytest.mark.requires_transformers


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python3 bench/cpu_threads.py` finds its siblings
    return importlib.import_module("cpu_threads")


def test_the_busy_process_is_stopped_when_the_run_fails(bench):
    with pytest.raises(RuntimeError, match="mid-run"), bench.busy_process(True) as proc:
        assert proc.poll() is None  # spinning
        raise RuntimeError("mid-run")
    assert proc.poll() is not None
    with bench.busy_process(False) as none:
        assert none is None


@pytest.mark.slow
def test_smoke_run_writes_every_figure_and_target(bench, tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "cpu_threads-random.json").read_text())
    assert doc["greedy_ids_identical"] is True
    for s in ("idle", "busy"):
        r = doc[s]
        assert set(r["results"]) == {"1", "all", "default"} and r["busy_process"] == (s == "busy")
        assert r["counts"]["1"] == 1 and r["counts"]["all"] == doc["all_cores"] >= r["counts"]["default"] >= 1
        assert all(v["decode_step_ms"] > 0 and v["tokens_per_s"] > 0 for v in r["results"].values())
    assert doc["busy"]["busy_process_ran_throughout"] is True
    assert len(doc["targets"]) == 3
    page = (tmp_path / "cpu_threads-random.md").read_text()
    assert "## Busy machine" in page and "Default: threads: " in page and "## Targets" in page
