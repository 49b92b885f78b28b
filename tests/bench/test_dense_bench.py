"""The bench scripts on CPU, so a GPU run is not spent on a typo: every script imports, and
bench/dense_prefill.py runs small shapes over the stand-ins, the code path the GPU run takes
(variants, correctness checks, result files); bench/prepare_host.py, a CPU bench, runs small."""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_bench_runs_on_cpu_standins(tmp_path, monkeypatch, fa3_standin, flashinfer_standin):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python3 bench/dense_prefill.py` finds its siblings
    bench = importlib.import_module("dense_prefill")
    rc = bench.main(["--device", "cpu", "--out", str(tmp_path), "--requests", "2", "--prefix", "16", "--fresh", "40",
                     "--hq", "4", "--hkv", "2", "--d", "64", "--layers", "2", "--reps", "1", "--page-size", "16"])
    doc = json.loads((tmp_path / "dense_prefill.json").read_text())
    assert rc == 0, doc
    for name in ("raw_fa3", "mstar_dense_fa3", "mstar_dense_flashinfer", "mstar_paged_flashinfer"):
        r = doc["results"][name]
        assert "skipped" not in r, r
        assert r["rel_error_vs_float64"] < 1.6e-2 and r["rel_diff_vs_raw_fa3"] < 1.6e-2
    assert doc["results"]["mstar_dense_fa3"]["rel_diff_vs_raw_fa3"] == 0.0  # same kernel, same data
    assert set(doc["targets"]) == {"dense_fa3_over_raw_fa3_per_layer", "paged_over_mstar_dense_fa3_per_step",
                                   "paged_over_mstar_dense_flashinfer_per_step"}
    assert "| mstar_dense_fa3 |" in (tmp_path / "dense_prefill.md").read_text()


def test_prepare_host_bench_runs_on_cpu(tmp_path, monkeypatch, flashinfer_standin):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("prepare_host")
    assert bench.main(["--out", str(tmp_path), "--rows", "8", "--reps", "5"]) == 0
    doc = json.loads((tmp_path / "prepare_host.json").read_text())
    assert [(r["backend"], r["rows"]) for r in doc["results"]] == [("reference", 8), ("flashinfer", 8)]
    fi = doc["results"][1]
    assert fi["inner_plan_us"] > 0 and fi["mstar_us"] == fi["prepare_us"] - fi["inner_plan_us"]
    assert "| flashinfer | 8 |" in (tmp_path / "prepare_host.md").read_text()


# the scripts that import transformers (or the integration) at their top
NEEDS_TRANSFORMERS = {"compiled_decode", "cpu_generate", "cpu_threads", "prefix_cache", "sampled_decode",
                      "transformers_check", "transformers_decode"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.requires_transformers] if name in NEEDS_TRANSFORMERS else [])
    for name in sorted(p.stem for p in BENCH.glob("*.py"))])
def test_every_bench_script_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    mod = importlib.import_module(name)
    assert name in ("paged", "report") or callable(getattr(mod, "main", None))


@pytest.mark.requires_transformers
def test_cpu_generate_bench_runs_small(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("cpu_generate")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "cpu_generate-random.json").read_text())
    assert doc["greedy_ids_identical"] and doc["threads"] == 1
    assert set(doc["targets"]) == {"mstar tokens/s / transformers generate (sdpa)", "greedy ids identical"}
