"""``mstar generate`` on a GGUF file written by the ``gguf`` package: the ids of the model it was
written from, its tokenizer's BOS and chat template, a directory holding one (or several) GGUF
files, and what is refused before the weights load."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from mstar_core.testing.hf_models import build

from ...helpers import hf_greedy
from .cli_runs import fails, run_json
from .gguf_files import BOS, write_llama_gguf

USER, ASSISTANT = 2, 4  # <|user|>, <|assistant|> in gguf_files.SPECIAL

pytestmark = pytest.mark.requires_gguf  # the files are written with gguf and read through accelerate


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    model = build("llama", seed=4)
    return write_llama_gguf(model, d / "tiny.gguf"), model


def test_a_gguf_file_generates_the_ids_of_the_model_it_holds(written, capsys):
    path, model = written
    out = run_json(capsys, str(path), "--ids", "--prompt", "5,6,7", "--prompt", "9 10", "--max-new-tokens", "6",
                   "--ignore-eos")
    assert out["weights"] == "loaded" and out["architecture"] == "LlamaForCausalLM"
    assert out["ids"] == [hf_greedy(model, [5, 6, 7], 6), hf_greedy(model, [9, 10], 6)]


def test_a_directory_with_one_gguf_and_its_tokenizer(written, capsys):
    path, model = written
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out = run_json(capsys, str(path.parent), "--prompt", "hi", "--max-new-tokens", "3", "--ignore-eos")
    assert out["prompts"][0]["ids"] == tok("hi")["input_ids"] and out["prompts"][0]["ids"][0] == BOS
    out = run_json(capsys, str(path.parent), "--chat", "--prompt", "hi", "--max-new-tokens", "3", "--ignore-eos")
    ids = out["prompts"][0]["ids"]
    assert ids[:2] == [BOS, USER] and ids[-1] == ASSISTANT and ids.count(BOS) == 1
    assert out["ids"] == [hf_greedy(model, ids, 3)]


def test_several_gguf_files_are_listed_and_one_asked_for(written, tmp_path, capsys):
    path, _ = written
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(path, tmp_path / name)
    err = fails(capsys, str(tmp_path), "--ids", "--prompt", "1")
    assert "holds 2 .gguf files (a.gguf, b.gguf): give the path of the one to load" in err


def test_checks_on_a_gguf_come_before_its_weights_load(written, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    path, _ = written

    def refuse(*a, **k):
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    err = fails(capsys, str(path), "--ids", "--prompt", "1,2", "--max-new-tokens", "2047")
    assert "more than the model's max_position_embeddings 2048: lower --max-new-tokens to at most 2046" in err
    assert "outside the vocabulary (ids 0..127)" in fails(capsys, str(path), "--ids", "--prompt", "200")


def test_a_damaged_gguf_file_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    err = fails(capsys, str(bad), "--ids", "--prompt", "1")
    assert f"GGUF file {str(bad)!r}: bad.gguf does not describe a model transformers can build" in err


def test_without_the_gguf_package_the_extra_is_named(written, capsys, monkeypatch):
    path, _ = written
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    err = fails(capsys, str(path), "--ids", "--prompt", "1")
    assert "reading a .gguf file needs the gguf and accelerate packages (missing: gguf): pip install " \
           "'.[transformers]' in a clone of mstar" in err
