"""The `mstar` command as a user runs it."""

import json
import subprocess
import sys

import pytest
import torch

from mstar_core.cli import build_parser, main


def mstar(*args, env=None):
    import os

    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "mstar_core.cli", *args], capture_output=True, text=True, env=e,
                          timeout=300)


@pytest.mark.slow
def test_demo_runs_and_reports():
    r = mstar("demo")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "backend: reference" in out and "OK" in out and "tokens/s" in out
    assert "prefill 1" in out and "mixed" in out and "decode" in out


@pytest.mark.slow
def test_unknown_backend_fails_listing_known_ones():
    r = mstar("demo", env={"MSTAR_ATTENTION_BACKEND": "nope"})
    assert r.returncode == 2
    assert "'nope'" in r.stderr and "Known backends:" in r.stderr and "reference" in r.stderr


def test_bench_json(capsys):
    assert main(["bench", "--steps", "3", "--warmup", "1", "--batch", "2", "--context", "20", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["backend"] == "reference" and res["median_step_ms"] > 0 and res["tokens_per_s"] > 0
    assert res["gpu_step_ms"] is None  # no CUDA here, and the output says so rather than inventing one


def test_bench_graphs_and_preplan_on_cpu(capsys):
    argv = ["bench", "--steps", "3", "--warmup", "1", "--batch", "3", "--context", "17", "--graphs", "--preplan"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "median step time" in out and "pre-plan on" in out
    # a CPU captures no CUDA graph: the line says what ran instead
    assert "graphs on: the graph path, replayed on cpu (no CUDA graphs: each replay re-runs the forward)" in out
    assert "CUDA graphs captured" not in out and "GPU time per step: n/a (no CUDA graphs on cpu)" in out


def test_bench_help_documents_every_option():
    sub = build_parser()._subparsers._group_actions[0].choices["bench"]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"--{action.dest} has no help"
    text = sub.format_help()
    for opt in ("--layers", "--qo-heads", "--kv-heads", "--head-dim", "--batch", "--context", "--backend",
                "--graphs", "--preplan", "--json"):
        assert opt in text


def test_bench_preplan_without_graphs_stays_off_and_says_why(capsys, caplog):
    import logging

    caplog.set_level(logging.WARNING)
    argv = ["bench", "--steps", "2", "--warmup", "1", "--batch", "2", "--context", "8", "--preplan", "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["preplan"] is False and res["graphs"] is False
    assert "pre-plan off: resources ['attn'] do not support it" in caplog.text


def test_bench_options_are_checked_by_name(capsys):
    assert main(["bench", "--batch", "0"]) == 2
    assert "bench: batch must be >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "--qo-heads", "6", "--kv-heads", "4"]) == 2
    assert "qo_heads (6) must be a multiple of kv_heads (4)" in capsys.readouterr().err


@pytest.mark.parametrize("args", [("backends", "--device", "cpu"), ("backends", "--device", "cpu", "--json")])
def test_a_reader_that_closes_stdout_early_ends_it_quietly(args):
    """`mstar backends | head -1`: the reader goes away before mstar writes; no traceback."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MSTAR_")}
    p = subprocess.Popen([sys.executable, "-m", "mstar_core.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # before the command has written anything: its first write meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err and "internal error" not in err, err
    assert err == ""  # and nothing else either



def test_a_closed_stdout_in_process_is_exit_1_and_nothing_on_stderr(monkeypatch, capsys):
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Closed())  # no file descriptor: nothing to redirect
    assert main(["backends", "--device", "cpu"]) == 1
    assert capsys.readouterr().err == ""


def test_bench_on_a_cpu_runs_what_auto_picks_and_its_help_says_so(monkeypatch, capsys):
    """A third-party plugin serving the paged path on the CPU outranks the reference under auto,
    and bench runs it, as its help says (the reference is what auto falls back to)."""
    from mstar_core import BackendSpec, Registry
    from mstar_core.backends.reference.plugin import REFERENCE

    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    paged = {c: REFERENCE.provides[c] for c in ("paged_prefill", "paged_decode", "mixed")}
    reg.register(BackendSpec(name="cpupaged", provides=paged, devices=("cpu",), dtypes=(torch.float32,)),
                 distribution="cpupaged-mstar", version="0.1.0")
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)
    argv = ["bench", "--steps", "2", "--warmup", "1", "--batch", "2", "--context", "8"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "cpupaged"
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("backend: cpupaged on cpu (float32)")
    assert main([*argv, "--backend", "reference", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "reference"

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert "On a CPU it runs on the reference backend" not in help_text
    assert ("Under auto, on a CPU, that is the reference unless an installed plugin provides a paged capability "
            "and can run here (device, dtype, head dim): auto tries third-party plugins before the "
            "reference") in help_text
