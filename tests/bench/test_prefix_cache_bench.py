"""bench/prefix_cache.py on CPU (reference backend, small sizes): the code path the GPU run takes,
its results file and its targets table, so a GPU run is not spent on a typo."""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
@pytest.mark.requires_transformers
def test_prefix_cache_bench_runs_small_on_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python3 bench/prefix_cache.py` finds its siblings
    bench = importlib.import_module("prefix_cache")
    assert bench.main(["--smoke", "--models", "smollm2_shape", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "prefix_cache.json").read_text())
    r = doc["smollm2_shape"]
    assert "error" not in r, r
    # 4 requests of a 64-token system prompt + 8: the first computes 72, the others 8 each
    assert (r["no_cache"]["prefill_tokens"], r["cache"]["prefill_tokens"]) == (288, 96)
    assert r["ids_identical"] and r["tokens_equal_fraction"] == 1.0
    assert r["lookup"]["tokens_found"] == 64 and r["lookup"]["admit_us"] > 0
    assert set(doc["targets"]) == {f"smollm2_shape: {k}" for k in (
        "prefill tokens with / without the cache", "time to first token without / with",
        "decode step with / without", "greedy ids identical")}
    assert "| smollm2_shape | 288 | 96 |" in (tmp_path / "prefix_cache.md").read_text()
