"""``mstar generate``: a local model directory (config only, or with safetensors weights and a
tokenizer), ids checked against transformers' own greedy generation of the same model."""

from __future__ import annotations

import json
import re

import pytest

from mstar_core.cli import main
from mstar_core.integrations.transformers.local import load
from mstar_core.testing.hf_models import build, config

from ...helpers import hf_greedy


def cli_json(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_config_only_directory_runs_random_weights_from_the_seed(tmp_path, capsys):
    config("qwen3").save_pretrained(tmp_path)
    out = cli_json(capsys, str(tmp_path), "--prompt", "1,2,3", "--prompt", "7 8 9 10 11", "--ids",
                   "--max-new-tokens", "12", "--seed", "3")
    assert out["weights"] == "random" and out["backend"] == "reference" and out["architecture"] == "Qwen3ForCausalLM"
    model, _, _ = load(tmp_path, seed=3)  # the same random weights
    assert out["ids"] == [hf_greedy(model, [1, 2, 3], 12), hf_greedy(model, [7, 8, 9, 10, 11], 12)]
    assert out["steps"]["decode"] >= 1 and out["new_tokens"] == 24


def test_weights_and_tokenizer_text_prompts(tmp_path, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    model = build("llama", seed=5)
    model.save_pretrained(tmp_path)
    words = ["[UNK]", "the", "cat", "sat", "on", "mat"] + [f"w{i}" for i in range(6, 128)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    out = cli_json(capsys, str(tmp_path), "--prompt", "the cat sat on the mat", "--max-new-tokens", "10")
    assert out["weights"] == "loaded"
    assert out["ids"] == [hf_greedy(model, [1, 2, 3, 4, 1, 5], 10)]
    assert out["texts"][0].split() == [words[i] for i in out["ids"][0]]


def test_text_output_names_backend_steps_and_ids(tmp_path, capsys):
    config("llama").save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "4,5", "--ids", "--max-new-tokens", "3"]) == 0
    text = capsys.readouterr().out
    assert "backend: reference" in text and "steps: 3 (prefill 1, mixed 0, decode 2" in text
    assert "tokens/s" in text and text.splitlines()[-1].startswith("[0] ")
    # no tokenizer: the ids line ends with why the request ended and how many tokens it made
    assert re.fullmatch(r"\[0\] \d+ \d+ \d+ \(finish: length, 3 tokens\)", text.splitlines()[-1])


@pytest.mark.parametrize("argv, message", [
    (["/nonexistent/model", "--prompt", "1"], "does not exist"),
    (["{cfg}", "--prompt", "hello there"], "has no tokenizer: give token ids with --ids"),
    (["{cfg}", "--prompt", "1"], "has no tokenizer: give token ids with --ids"),
    (["{cfg}", "--prompt", "1", "--ids", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["{empty}", "--prompt", "1", "--ids"], "no config.json (nor a .gguf file)"),
])
def test_bad_input_is_one_clear_line(tmp_path, capsys, argv, message):
    config("llama").save_pretrained(tmp_path / "cfg")
    (tmp_path / "empty").mkdir()
    argv = [a.format(cfg=tmp_path / "cfg", empty=tmp_path / "empty") for a in argv]
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


