"""``--threads N`` of ``mstar demo`` and ``mstar generate``: checked, applied to torch before the
run, printed as one line (a JSON field with ``--json``) and logged; ``OMP_NUM_THREADS``, then the
free cores, when it is left out."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mstar_core import threads
from mstar_core.cli import build_parser, main


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The commands set torch's process-wide count; the next test gets the one it had."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_demo_threads_1_prints_the_line_and_runs(capsys):
    torch.set_num_threads(2)
    assert main(["demo", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "threads: 1 (--threads 1)"
    assert "backend: reference" in lines[1] and lines[-1].endswith("OK")
    assert torch.get_num_threads() == 1


# The runs below end on one thread: on a busy 2-core machine two made the denoise demo take seconds, not 0.1 s.
def test_the_flag_wins_over_omp_num_threads(capsys, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert main(["demo", "--workload", "denoise", "--threads", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "threads: 1 (--threads 1)"
    assert torch.get_num_threads() == 1
    assert "demo: threads: 1 (--threads 1)" in caplog.text  # logged at INFO too


def test_omp_num_threads_wins_over_the_default(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(threads, "read_machine", lambda: pytest.fail("the machine was read"))
    torch.set_num_threads(2)
    assert main(["demo", "--workload", "denoise"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "threads: 1 (OMP_NUM_THREADS=1; --threads N to choose)"
    assert torch.get_num_threads() == 1


def test_the_default_leaves_out_the_cores_other_processes_keep_busy(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "read_machine", lambda: (2, 1.0, None, None))
    torch.set_num_threads(2)
    assert main(["demo", "--workload", "denoise"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "threads: 1 (2 cores, 1.0 busy with other processes; --threads N to choose)"
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("command", ["demo", "generate"])
@pytest.mark.parametrize("value", ["0", "-2", "1.5", "two", "2,1", "100000", ""])
def test_a_bad_count_is_refused_naming_it_and_what_is_accepted(capsys, command, value):
    argv = [command, "--threads", value] if command == "demo" else [command, "/nonexistent", "--threads", value]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert f"mstar {command}: error: {command}: --threads {value!r} is not a thread count; give an integer " \
           "from 1 to 1024" in captured.err
    assert "Traceback" not in captured.err and "threads:" not in captured.out  # refused before anything ran


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_help_documents_the_option(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    text = " ".join(sub.format_help().split())
    assert "--threads N" in text and "OMP_NUM_THREADS" in text and "several mstar processes" in text


@pytest.mark.requires_transformers
def test_generate_json_carries_the_count_and_prints_no_line(tmp_path, capsys):
    from mstar_core.testing.hf_models import config

    config("llama").save_pretrained(tmp_path)
    argv = ["generate", str(tmp_path), "--prompt", "4,5", "--ids", "--max-new-tokens", "2", "--threads", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)  # stdout is one JSON object, the threads line not in it
    assert out["threads"] == 1 and out["threads_why"] == "--threads 1"


@pytest.mark.requires_transformers
def test_generate_text_output_opens_with_the_line(tmp_path, capsys, monkeypatch):
    from mstar_core.testing.hf_models import config

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config("llama").save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "4,5", "--ids", "--max-new-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "threads: 1 (OMP_NUM_THREADS=1; --threads N to choose)"
    assert "backend: reference" in text
