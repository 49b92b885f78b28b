"""A local model directory whose files are damaged: one line naming the directory and the file
(and, for JSON, the line and column), exit status 2, no traceback; and what generate says of
graph steps and cache sizes on a CPU."""

from __future__ import annotations

import json
import shutil

import pytest

from mstar_core.cli import main
from mstar_core.errors import InputError
from mstar_core.integrations.transformers.local import load
from mstar_core.testing.hf_models import build


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama with safetensors weights and a tokenizer, saved once."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("model")
    build("llama", seed=1).save_pretrained(d)
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]", "a", "b"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    return d


@pytest.fixture
def model_dir(saved, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(saved, d)
    return d


def _generate_fails(capsys, d, *extra: str) -> str:
    assert main(["generate", str(d), "--prompt", "1,2", "--ids", *(extra or ("--max-new-tokens", "2"))]) == 2
    whole = capsys.readouterr().err
    assert "Traceback" not in whole
    err = whole.splitlines()[-1]  # after transformers' loading bar, where the weights load
    assert err.startswith("mstar generate: error: ") and "internal error" not in err
    return err


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json", "generation_config.json"])
def test_a_json_file_that_is_not_json_names_the_file_line_and_column(model_dir, capsys, name):
    (model_dir / name).write_text('{\n  "a": 1,\n  "b": \n}\n')
    err = _generate_fails(capsys, model_dir)
    assert f"model directory {str(model_dir)!r}: {name} is not valid JSON (line 4, column 1: Expecting value)" in err


def test_a_config_that_is_not_an_object_or_no_model_is_named(model_dir, capsys):
    (model_dir / "config.json").write_text("[1, 2]")
    assert "config.json must hold a JSON object, got list" in _generate_fails(capsys, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    assert "config.json does not describe a model transformers can build" in _generate_fails(capsys, model_dir)


def test_a_json_file_that_is_not_utf8_is_named(model_dir, capsys):
    (model_dir / "config.json").write_bytes(b'{"a": "\xff"}')
    assert "config.json is not UTF-8 text (byte offset 7" in _generate_fails(capsys, model_dir)


@pytest.mark.parametrize("cut,why", [
    (0.5, "the file holds"), (4, "less than the 8-byte header length"), (20, "bytes of header"),
])
def test_a_truncated_safetensors_file_is_named(model_dir, capsys, cut, why):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut) if isinstance(cut, float) else cut])
    err = _generate_fails(capsys, model_dir)
    assert f"model directory {str(model_dir)!r}: model.safetensors is truncated or corrupt: " in err and why in err


def test_a_safetensors_header_that_is_not_json_is_named(model_dir, capsys):
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\x00\x01\x02\x03"
    path.write_bytes(bytes(data))
    assert "model.safetensors is truncated or corrupt: its header is not a safetensors header" in \
        _generate_fails(capsys, model_dir)


def test_a_tokenizer_that_cannot_load_names_its_files(model_dir):
    (model_dir / "tokenizer.json").write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(InputError, match=r"the tokenizer \(tokenizer\.json, tokenizer_config\.json\) cannot be "
                                         r"loaded"):
        load(model_dir)


def test_the_undamaged_directory_loads(model_dir):
    model, tokenizer, weights = load(model_dir)
    assert weights and tokenizer is not None


def test_graph_steps_on_cpu_are_not_called_cuda_graphs(model_dir, capsys):
    assert main(["generate", str(model_dir), "--prompt", "1,2", "--ids", "--max-new-tokens", "3", "--graphs"]) == 0
    out = capsys.readouterr().out
    assert "replayed from CUDA graphs" not in out
    assert "through the graph path on cpu (no CUDA graphs: each replay re-runs the forward)" in out


def test_a_cache_past_the_memory_is_refused_naming_max_new_tokens(model_dir, capsys):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = 10**14  # positions enough: the cache's size is what is refused
    (model_dir / "config.json").write_text(json.dumps(cfg))
    err = _generate_fails(capsys, model_dir, "--max-new-tokens", str(10**13))
    assert "Engine: the KV cache of max_pages" in err and "max_new_tokens" in err
    assert "more than the" in err and "available on cpu" in err
