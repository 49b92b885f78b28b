"""bench/transformers_check.py on CPU at its tiny size, so a GPU run is not spent on a script the
engine has moved under: the teacher-forced steps give logits (the engine's own steps give the next
token), compared with transformers' eager logits."""

from __future__ import annotations

import importlib
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.requires_transformers
def test_the_teacher_forced_check_runs_small_on_cpu(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("transformers_check")
    r = bench.check("llama", "reference", "cpu", 4, 0, "tiny")
    assert r["backend"] == "reference" and r["greedy_total"] == 4 * len(bench.LENGTHS)
    # bf16 on both sides: mstar's teacher-forced logits within the eager bf16-vs-fp32 difference's scale
    assert r["tf_max_abs_err"] < 2 * r["bf16_vs_fp32_eager_max_abs"] + 0.1
    assert r["tf_argmax_share"] >= 0.9
