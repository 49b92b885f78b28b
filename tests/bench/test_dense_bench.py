"""bench/dense_bench.py on CPU, small shapes, over the stand-ins: the same code path the GPU run
takes (variants, correctness checks, result files), so the one GPU run is not spent on a typo."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "dense_bench.py"


@pytest.mark.slow
def test_bench_runs_on_cpu_standins(tmp_path, fa3_standin, flashinfer_standin):
    spec = importlib.util.spec_from_file_location("dense_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--device", "cpu", "--out", str(tmp_path), "--requests", "2", "--prefix", "16", "--fresh", "40",
                     "--hq", "4", "--hkv", "2", "--d", "64", "--layers", "2", "--reps", "1", "--page-size", "16"])
    doc = json.loads((tmp_path / "dense_bench.json").read_text())
    assert rc == 0, doc
    for name in ("raw_fa3", "mstar_dense_fa3", "mstar_dense_flashinfer", "mstar_paged_flashinfer"):
        r = doc["results"][name]
        assert "skipped" not in r, r
        assert r["rel_error_vs_float64"] < 1.6e-2 and r["rel_diff_vs_raw_fa3"] < 1.6e-2
    assert doc["results"]["mstar_dense_fa3"]["rel_diff_vs_raw_fa3"] == 0.0  # same kernel, same data
    assert set(doc["targets"]) == {"dense_fa3_over_raw_fa3_per_layer", "paged_over_mstar_dense_fa3_per_step",
                                   "paged_over_mstar_dense_flashinfer_per_step"}
    assert "| mstar_dense_fa3 |" in (tmp_path / "dense_bench.md").read_text()
