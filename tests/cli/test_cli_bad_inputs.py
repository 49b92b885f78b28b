"""Bad command-line values refused with one clear line and exit status 2, naming the value and
what is allowed, before any model is built."""

from __future__ import annotations

import pytest

from mstar_core import reset_registry
from mstar_core.cli import main


@pytest.mark.parametrize("head_dim", [3, 63, 1])
def test_bench_odd_head_dim(capsys, head_dim):
    assert main(["bench", "--head-dim", str(head_dim)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar bench: error: ")
    assert f"--head-dim {head_dim} is odd" in err and "must be even" in err and "rotary" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("option,value,name", [
    ("--head-dim", "0", "head_dim"), ("--head-dim", "-4", "head_dim"), ("--layers", "0", "layers"),
    ("--qo-heads", "-1", "qo_heads"), ("--kv-heads", "0", "kv_heads"), ("--hidden", "0", "hidden"),
    ("--page-size", "0", "page_size"), ("--steps", "0", "steps"), ("--warmup", "0", "warmup"),
])
def test_bench_counts_must_be_positive(capsys, option, value, name):
    assert main(["bench", option, value]) == 2
    assert f"bench: {name} must be >= 1, got {value}" in capsys.readouterr().err


def test_bench_context_must_not_be_negative(capsys):
    assert main(["bench", "--context", "-1"]) == 2
    assert "bench: context must be >= 0, got -1" in capsys.readouterr().err


def test_bench_even_head_dim_runs(capsys):
    assert main(["bench", "--head-dim", "2", "--qo-heads", "1", "--kv-heads", "1", "--hidden", "8", "--steps", "1",
                 "--warmup", "1", "--batch", "1", "--context", "3", "--json"]) == 0


@pytest.mark.parametrize("seed", [2**70, 2**64, -1, -(2**63)])
def test_demo_seed_outside_torch_range(capsys, seed):
    assert main(["demo", "--seed", str(seed)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar demo: error: ")
    assert f"--seed {seed} is out of range" in err and "0 to 18446744073709551615" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("workload", ["text", "denoise"])
def test_demo_seed_at_the_top_of_the_range_is_accepted(monkeypatch, workload):
    """2**64 - 1 is a seed torch takes: it reaches the workload unchanged."""
    from mstar_core.demo import denoise, text

    seen = []
    for mod in (text, denoise):
        monkeypatch.setattr(mod, "main", lambda **kw: seen.append(kw["seed"]) or 0)
    assert main(["demo", "--workload", workload, "--seed", str(2**64 - 1)]) == 0
    assert seen == [2**64 - 1]


def test_backends_head_dim_must_be_positive(capsys):
    assert main(["backends", "--head-dim", "0"]) == 2
    assert "backends: --head-dim 0 must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_backends_with_a_bad_strict_value_names_variable_value_and_choices(monkeypatch, capsys, value):
    monkeypatch.setenv("MSTAR_STRICT_PLUGINS", value)
    reset_registry()
    try:
        assert main(["backends"]) == 2
    finally:
        reset_registry()
    err = capsys.readouterr().err
    assert err.startswith("mstar backends: error: ")
    assert f"MSTAR_STRICT_PLUGINS={value!r}" in err and "1, true, yes, on" in err and "0, false, no, off" in err
