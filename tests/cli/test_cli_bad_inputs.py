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


# -- --device, checked where it enters ------------------------------------------------------------

def _cpu_only_torch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("argv", [
    ["bench"], ["demo"], ["demo", "--workload", "denoise"], ["warmup"],
    ["generate", "/nonexistent", "--prompt", "1"],
])
def test_device_cuda_with_a_cpu_only_torch_is_one_line_naming_it(capsys, monkeypatch, argv):
    _cpu_only_torch(monkeypatch)
    device = [] if argv == ["warmup"] else ["--device", "cuda"]  # warmup's default is cuda
    assert main([*argv, *device]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: this torch (" in err and "was built without CUDA; use --device cpu" in err
    assert "Traceback" not in err and "AssertionError" not in err


def test_device_cuda_without_a_usable_gpu_names_it(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "bench: --device cuda: no CUDA device is usable here" in err and "use --device cpu" in err


def test_a_gpu_index_past_the_gpus_is_refused(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["demo", "--device", "cuda:5"]) == 2
    assert "demo: --device cuda:5: this machine shows 2 GPU(s) (cuda:0..cuda:1)" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench"], ["demo"], ["warmup"], ["backends"], ["check", "reference"],
                                  ["generate", "/nonexistent", "--prompt", "1"]])
@pytest.mark.parametrize("device,message", [("gpu", "'gpu' is not a torch device; use cpu, cuda or cuda:N"),
                                            ("", "'' is not a torch device"),
                                            ("meta", "mstar runs on cpu or cuda")])
def test_a_device_that_is_not_one_mstar_runs_on(capsys, argv, device, message):
    assert main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err
    assert f"--device {message}" in err.replace("--device 'meta': ", "--device ") and "Traceback" not in err


# -- sizes that do not fit, refused before anything is allocated -------------------------------------

@pytest.mark.parametrize("option,value", [
    ("--layers", 10**9), ("--page-size", 10**8), ("--context", 10**12), ("--batch", 10**9), ("--hidden", 10**9),
    ("--steps", 10**12),
])
def test_bench_sizes_past_the_memory_name_the_options(capsys, monkeypatch, option, value):
    import torch

    from mstar_core.demo import decode_bench

    def no_alloc(*a, **kw):
        raise AssertionError("allocated before the memory check")

    monkeypatch.setattr(decode_bench, "TinyDecoder", no_alloc)
    monkeypatch.setattr(decode_bench, "KVManager", no_alloc)
    monkeypatch.setattr(torch, "randn", no_alloc)
    assert main(["bench", option, str(value)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar bench: error: bench: the KV cache (") and f"{option} {value}" in err
    assert "more than the" in err and "available on cpu" in err and "Traceback" not in err


def test_bench_refuses_against_the_memory_available(capsys, monkeypatch):
    """The default sizes (a few MiB) against a device with 1 MiB free: refused, naming the estimate."""
    from mstar_core import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**20)
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "more than the 1.0 MiB available on cpu" in err and "--layers 2" in err


def test_memory_check_fits_and_refuses():
    from mstar_core.errors import InputError
    from mstar_core.memory import available_bytes, check_fits

    have = available_bytes("cpu")
    assert isinstance(have, int) and have > 0
    check_fits(1, "cpu", "one byte")  # fits
    with pytest.raises(InputError, match=r"^the thing needs about .* TiB, more than the .* available on cpu"):
        check_fits(have * 2 + 2**40, "cpu", "the thing")
    with pytest.raises(InputError, match="nbytes must be an int >= 0"):
        check_fits(-1, "cpu", "x")
    assert available_bytes("meta") is None  # not known: nothing refused
    check_fits(10**30, "meta", "x")


# -- graphs on a CPU: what runs, in words --------------------------------------------------------------

def test_bench_graphs_on_cpu_do_not_claim_cuda_graphs():
    from mstar_core.demo.decode_bench import BenchResult

    cpu = BenchResult("reference", "cpu", "float32", True, False, 1.0, 1.0, 1.0, None, {})
    assert "graphs on: the graph path, replayed on cpu (no CUDA graphs: each replay re-runs the forward)" in \
        cpu.lines()[0]
    assert cpu.lines()[3] == "GPU time per step: n/a (no CUDA graphs on cpu)"
    cuda_off = BenchResult("reference", "cuda:0", "bfloat16", False, False, 1.0, 1.0, 1.0, None, {})
    assert "graphs off" in cuda_off.lines()[0] and cuda_off.lines()[3] == "GPU time per step: n/a (graphs off)"
    cuda = BenchResult("reference", "cuda:0", "bfloat16", True, False, 1.0, 1.0, 1.0, 0.5, {})
    assert "graphs on, pre-plan off" in cuda.lines()[0]


# -- new-backend: bad names and directories, nothing left behind ---------------------------------------

@pytest.mark.parametrize("name", ["a" * 300, "a" * 65, "9lives", "My", "has-dash", "", "a b"])
def test_new_backend_refuses_a_name_outside_the_rule(tmp_path, capsys, name):
    assert main(["new-backend", name, str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "must start with a lowercase letter" in err and "at most 64 characters" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_new_backend_accepts_a_name_of_64_characters(tmp_path):
    from mstar_core.scaffold import write_skeleton

    assert write_skeleton("a" * 64, tmp_path / "d")


@pytest.mark.parametrize("make", ["file_in_the_way", "name_too_long"])
def test_new_backend_an_uncreatable_dir_names_it_and_leaves_nothing(tmp_path, capsys, make):
    if make == "file_in_the_way":
        (tmp_path / "afile").write_text("x")
        target = tmp_path / "afile" / "sub" / "x"
    else:
        target = tmp_path / "new" / ("d" * 300)
    before = sorted(tmp_path.rglob("*"))
    assert main(["new-backend", "ok", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"new-backend: cannot create {str(target)!r}" in err and "nothing was written" in err
    assert "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before  # "new" made on the way is gone again


def test_new_backend_an_empty_dir_is_refused(capsys):
    assert main(["new-backend", "ok", ""]) == 2
    assert "new-backend: DIR is empty" in capsys.readouterr().err


# -- other bad values ---------------------------------------------------------------------------------

def test_generate_seed_error_names_generate(capsys):
    assert main(["generate", "/nonexistent", "--prompt", "1", "--seed", "-1"]) == 2
    assert "mstar generate: error: generate: --seed -1 is out of range" in capsys.readouterr().err


def test_an_empty_config_path_is_refused(capsys):
    assert main(["bench", "--config", ""]) == 2
    assert "config file path is empty" in capsys.readouterr().err


def test_an_empty_backend_name_says_so(capsys):
    assert main(["bench", "--backend", ""]) == 2
    assert "an empty name names no backend; give a backend name or 'auto'" in capsys.readouterr().err
