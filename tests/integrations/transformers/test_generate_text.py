"""``mstar generate`` with a tokenizer that adds a BOS and has a chat template: text is always
text (ids only with --ids), plain text gets the tokenizer's BOS and templated text only the
template's, --chat/--system, prompt files (text and JSONL), --ignore-eos, --stop, sampling flags
and the engine's sizes, and the JSON report's fields."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from mstar_core.cli import main
from mstar_core.testing.hf_models import build

from ...helpers import hf_greedy
from .cli_runs import fails, run_json, run_text

WORDS = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "the", "cat", "sat", "on", "mat"]
UNK, BOS, EOS, USER, ASSISTANT, SYSTEM, THE, CAT, SAT, ON, MAT = range(len(WORDS))
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A word-level tokenizer whose post-processor adds ``<s>``, as most real ones do."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    words = WORDS + [f"w{i}" for i in range(len(WORDS), 128)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
                                   chat_template=chat_template)


def without_chat_template(model_dir, dest):
    """A copy of ``model_dir`` whose tokenizer has no chat template."""
    shutil.copytree(model_dir, dest)
    tokenizer(chat_template=None).save_pretrained(dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    return dest


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("instruct")
    model = build("llama", seed=7)
    model.save_pretrained(d)
    tokenizer().save_pretrained(d)
    return d, model


def test_plain_text_gets_the_tokenizers_bos_and_digits_stay_text(saved, capsys):
    d, model = saved
    out = run_json(capsys, str(d), "--prompt", "the cat sat", "--prompt", "2024", "--prompt", "1 2 3",
                   "--max-new-tokens", "5")
    assert [p["ids"] for p in out["prompts"]] == [[BOS, THE, CAT, SAT], [BOS, UNK], [BOS, UNK, UNK, UNK]]
    assert out["ids"][0] == hf_greedy(model, [BOS, THE, CAT, SAT], 5)


def test_ids_are_taken_as_given(saved, capsys):
    d, model = saved
    out = run_json(capsys, str(d), "--ids", "--prompt", "6 7 8", "--prompt", "9,10", "--max-new-tokens", "4")
    assert [p["ids"] for p in out["prompts"]] == [[THE, CAT, SAT], [ON, MAT]]
    assert [p["text"] for p in out["prompts"]] == [None, None]
    assert out["ids"] == [hf_greedy(model, [THE, CAT, SAT], 4), hf_greedy(model, [ON, MAT], 4)]


def test_chat_applies_the_template_with_one_bos(saved, capsys):
    d, model = saved
    out = run_json(capsys, str(d), "--chat", "--prompt", "the cat", "--max-new-tokens", "3")
    ids = out["prompts"][0]["ids"]
    assert ids == [BOS, USER, THE, CAT, ASSISTANT] and ids.count(BOS) == 1
    assert out["ids"] == [hf_greedy(model, ids, 3)]


def test_system_comes_before_the_user_message(saved, capsys):
    d, _ = saved
    out = run_json(capsys, str(d), "--chat", "--system", "on the mat", "--prompt", "the cat", "--max-new-tokens", "2")
    assert out["prompts"][0]["ids"] == [BOS, SYSTEM, ON, THE, MAT, USER, THE, CAT, ASSISTANT]


def test_prompt_file_one_prompt_a_line_blank_lines_skipped(saved, tmp_path, capsys):
    d, _ = saved
    f = tmp_path / "prompts.txt"
    f.write_text("the cat\n\n   \non the mat\n")
    out = run_json(capsys, str(d), "--prompt", "sat", "--prompt-file", str(f), "--max-new-tokens", "2")
    rows = out["prompts"]
    assert [r["text"] for r in rows] == ["sat", "the cat", "on the mat"]
    assert [r["source"] for r in rows] == ["--prompt 1", f"--prompt-file {str(f)!r} line 1",
                                           f"--prompt-file {str(f)!r} line 4"]
    f.write_text("6 7\n8,9\n")
    out = run_json(capsys, str(d), "--ids", "--prompt-file", str(f), "--max-new-tokens", "2")
    assert [r["ids"] for r in out["prompts"]] == [[THE, CAT], [SAT, ON]]


def test_jsonl_prompt_messages_and_ids(saved, tmp_path, capsys):
    d, _ = saved
    f = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "the cat"}, {"messages": [{"role": "user", "content": "the mat"}]},
             {"messages": [{"role": "system", "content": "cat"}, {"role": "user", "content": "mat"}]},
             {"ids": [6, 7]}]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = run_json(capsys, str(d), "--prompt-file", str(f), "--max-new-tokens", "2")
    assert [r["ids"] for r in out["prompts"]] == [
        [BOS, THE, CAT],  # "prompt" is plain text without --chat
        [BOS, USER, THE, MAT, ASSISTANT],  # "messages" always take the template
        [BOS, SYSTEM, CAT, USER, MAT, ASSISTANT],
        [THE, CAT],
    ]
    assert out["prompts"][1]["messages"] == lines[1]["messages"]
    out = run_json(capsys, str(d), "--prompt-file", str(f), "--chat", "--system", "on", "--max-new-tokens", "2")
    assert [r["ids"][:3] for r in out["prompts"][:3]] == [[BOS, SYSTEM, ON], [BOS, SYSTEM, ON], [BOS, SYSTEM, CAT]]


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a"}\n{"prompt": ', "line 2: not valid JSON (column 12"),
    ('["a"]', "line 1: each line must be a JSON object with one of ['prompt', 'messages', 'ids'], got list"),
    ('{"prompt": "a", "ids": [1]}', "line 1: keys ['prompt', 'ids']; each line holds exactly one of"),
    ('{"text": "a"}', "line 1: unknown keys ['text']; each line holds exactly one of ['prompt', 'messages', 'ids']"),
    ('{"messages": "hi"}', 'line 1: "messages" must be a non-empty list of objects with string "role"'),
    ('{"ids": [1, "2"]}', 'line 1: "ids" must be a non-empty list of integers'),
    ('{"prompt": 5}', 'line 1: "prompt" must be a string, got int'),
    ("\n\n", "holds no prompts (blank lines are skipped)"),
])
def test_a_bad_prompt_file_names_the_file_and_line(tmp_path, capsys, text, message):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    err = fails(capsys, str(tmp_path / "never-read"), "--prompt-file", str(f))
    assert f"--prompt-file {str(f)!r}" in err and message in err


def test_ignore_eos_runs_past_the_end_of_sequence_token(saved, tmp_path, capsys):
    d, model = saved
    first = hf_greedy(model, [BOS, THE], 1)[0]
    d2 = tmp_path / "m"
    shutil.copytree(d, d2)
    cfg = json.loads((d2 / "generation_config.json").read_text()) if (d2 / "generation_config.json").exists() else {}
    (d2 / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": first}))
    out = run_json(capsys, str(d2), "--prompt", "the", "--max-new-tokens", "6")
    assert out["ids"] == [[first]] and out["prompts"][0]["finish"] == "eos"
    out = run_json(capsys, str(d2), "--prompt", "the", "--max-new-tokens", "6", "--ignore-eos")
    assert out["ids"] == [hf_greedy(model, [BOS, THE], 6)] and out["prompts"][0]["finish"] == "length"


def test_json_fields_and_the_text_report(saved, capsys):
    d, model = saved
    out = run_json(capsys, str(d), "--prompt", "the cat", "--prompt", "on", "--max-new-tokens", "3")
    assert out["load_seconds"] > 0 and out["first_token_s_median"] > 0
    for key in ("model", "architecture", "weights", "backend", "device", "dtype", "steps", "waits", "new_tokens",
                "seconds", "tokens_per_s", "compiled", "prefix_hit_rate", "prefill_tokens", "ids", "texts", "prompts"):
        assert key in out
    row = out["prompts"][0]
    assert set(row) == {"source", "text", "ids", "generated_ids", "generated_text", "finish", "first_token_s",
                        "cached_tokens"}
    assert row["cached_tokens"] is None and out["prefix_hit_rate"] is None  # the prefix cache is off by default
    assert row["text"] == "the cat" and row["generated_ids"] == out["ids"][0] == hf_greedy(model, row["ids"], 3)
    assert row["generated_text"] == " ".join(WORDS[i] if i < len(WORDS) else f"w{i}" for i in row["generated_ids"]
                                             if i not in (BOS, EOS, USER, ASSISTANT, SYSTEM))
    assert row["first_token_s"] > 0 and out["texts"][0] == row["generated_text"]
    assert main(["generate", str(d), "--prompt", "the cat", "--max-new-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert f"model: LlamaForCausalLM from {d} (weights, float32 on cpu), loaded in " in text
    assert "time to first token: median" in text


def test_engine_sizes_change_nothing_in_the_ids(saved, capsys):
    d, _ = saved
    argv = ["--prompt", "the cat", "--prompt", "on the mat sat", "--max-new-tokens", "5"]
    base = run_json(capsys, str(d), *argv)["ids"]
    small = run_json(capsys, str(d), *argv, "--batch-size", "1", "--page-size", "2", "--max-pages", "8")
    assert small["ids"] == base and small["steps"]["mixed"] == 0  # one request a step: never prefill with decode


def test_stop_ends_at_the_token_completing_it_and_cuts_the_text(saved, capsys):
    d, _ = saved
    argv = ["--prompt", "the cat", "--max-new-tokens", "12", "--ignore-eos"]
    full = run_json(capsys, str(d), *argv)["prompts"][0]
    words = full["generated_text"].split()
    # the first word after the first that the text before it does not hold (the cut is at the first match)
    k = next(i for i in range(1, len(words)) if words[i] not in " ".join(words[:i]))
    out = run_json(capsys, str(d), *argv, "--stop", words[k], "--stop", "never-said")
    row = out["prompts"][0]
    assert row["generated_ids"] == full["generated_ids"][: k + 1] and row["finish"] == "stop"
    assert row["generated_text"] == " ".join(words[:k]) + " "


def test_sampling_seeds_are_per_prompt(saved, capsys):
    d, _ = saved
    flags = ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--min-p", "0.01",
             "--repetition-penalty", "1.1", "--max-new-tokens", "8"]
    both = run_json(capsys, str(d), "--prompt", "the cat", "--prompt", "on the mat", *flags, "--sampling-seed", "5")
    again = run_json(capsys, str(d), "--prompt", "the cat", "--prompt", "on the mat", *flags, "--sampling-seed", "5")
    # prompt 1 drew with seed 5 + 1
    alone = run_json(capsys, str(d), "--prompt", "on the mat", *flags, "--sampling-seed", "6")
    assert both["ids"] == again["ids"] and alone["ids"] == [both["ids"][1]]


def _no_weights(monkeypatch):
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--ids", "--prompt", "1,128"], "--prompt 1 has token ids [128] outside the vocabulary (ids 0..127)"),
    (["--ids", "--prompt", "3 -1"], "--prompt 1 has token ids [-1] outside the vocabulary (ids 0..127)"),
    (["--ids", "--prompt", "1,x"], "--prompt 1: 'x' is not a token id (with --ids a prompt is ids"),
    (["--ids", "--prompt", " , "], "--prompt 1: no token ids"),
    (["--prompt", "the cat sat", "--max-new-tokens", "2047"],
     "--prompt 1 (4 tokens) + --max-new-tokens 2047 = 2051 positions, more than the model's "
     "max_position_embeddings 2048: lower --max-new-tokens to at most 2044"),
    (["--chat", "--prompt", "x", "--ids"], "--chat puts text prompts through the chat template, --ids says"),
    (["--system", "be brief", "--prompt", "x"], "--system is a chat's system message: give --chat with it"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p 1.5: top_p must be in (0, 1]"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature -1.0: temperature must be >= 0"),
    (["--prompt", "x", "--sampling-seed", "-1"], "--sampling-seed must be in 0..2**63-1"),
    (["--prompt", "x", "--stop", ""], "--stop takes a non-empty string"),
    (["--prompt", "x", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--prompt", "x", "--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["--prompt", "x", "--max-pages", "0"], "--max-pages must be >= 1, got 0"),
    ([], "no prompts: give --prompt TEXT (repeatable) or --prompt-file FILE"),
])
def test_checks_come_before_the_weights_load(saved, capsys, monkeypatch, argv, message):
    d, _ = saved
    _no_weights(monkeypatch)
    assert message in fails(capsys, str(d), *argv)


def test_text_or_chat_the_tokenizer_cannot_serve_is_refused_before_the_weights(saved, tmp_path, capsys, monkeypatch):
    d, _ = saved
    _no_weights(monkeypatch)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(d / "config.json", bare / "config.json")
    assert "--prompt 1 is text, and model directory" in fails(capsys, str(bare), "--prompt", "the cat")
    assert "has no tokenizer: give token ids with --ids" in fails(capsys, str(bare), "--prompt", "the cat")
    plain = without_chat_template(d, tmp_path / "plain")
    assert "--prompt 1: --chat needs a chat template, and the tokenizer of model directory" in \
        fails(capsys, str(plain), "--chat", "--prompt", "the cat")


def test_stop_strings_check_only_the_tail():
    from mstar_core.integrations.transformers.text import StopStrings

    tok = tokenizer()
    stop = StopStrings(tok, ["cat sat"])
    assert not stop(0, [THE, CAT]) and stop(0, [THE, CAT, SAT]) and stop(0, [MAT] * 500 + [CAT, SAT])
    assert stop.window == len("cat sat") + 4
    assert stop.cut("the cat sat on") == ("the ", True) and stop.cut("the mat") == ("the mat", False)


def test_a_cut_ends_at_the_earliest_stop_whichever_is_listed_first():
    from mstar_core.integrations.transformers.text import StopStrings

    stop = StopStrings(tokenizer(), ["mat", "cat"])
    # "cat" comes first and again last; "mat" sits between them
    assert stop.cut("the cat sat on the mat the cat") == ("the ", True)
    assert stop.cut("on the mat the cat") == ("on the ", True)


@pytest.fixture(scope="module")
def ends_at_once(saved, tmp_path_factory):
    """The instruct directory with its end-of-sequence id set to the token greedy decoding puts
    first after ``<s> the``: that prompt ends at once, as an instruct model's plain text often does."""
    d, model = saved
    first = hf_greedy(model, [BOS, THE], 1)[0]
    d2 = tmp_path_factory.mktemp("ends-at-once") / "m"
    shutil.copytree(d, d2)
    gen = d2 / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**cfg, "eos_token_id": first}))
    return d2, first


def test_a_text_prompt_that_ends_at_once_gets_one_hint_to_use_chat(ends_at_once, capsys):
    d, first = ends_at_once
    out, err = run_text(capsys, str(d), "--prompt", "the", "--prompt", "the", "--max-new-tokens", "6")
    lines = out.splitlines()
    text = WORDS[first] if first < len(WORDS) else f"w{first}"
    shown = "" if first in (BOS, EOS, USER, ASSISTANT, SYSTEM) else text  # special tokens are not decoded
    assert lines[-4:] == [f"[0] {first}", f"[0] {shown!r} (finish: eos, 1 token)",
                          f"[1] {first}", f"[1] {shown!r} (finish: eos, 1 token)"]
    hints = [x for x in err.splitlines() if "hint:" in x]
    assert hints == ["mstar generate: hint: [0], [1] ended at once (the first new token was end-of-sequence); the "
                     "tokenizer has a chat template, and an instruct model expects its prompts put through it: try "
                     "--chat"]
    # --json: stdout is the JSON alone, the hint is on stderr
    assert main(["generate", str(d), "--prompt", "the", "--max-new-tokens", "6", "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["prompts"][0]["finish"] == "eos" and "hint: [0] ended at once" in got.err


def test_no_chat_hint_for_chats_ids_longer_answers_or_a_tokenizer_without_a_template(ends_at_once, tmp_path,
                                                                                   capsys):
    d, first = ends_at_once
    _, err = run_text(capsys, str(d), "--chat", "--prompt", "the", "--max-new-tokens", "2")
    assert "hint" not in err
    # a chat that ended at once gets no hint either: it went through the template already
    from mstar_core.cli.generate import _chat_hint
    from mstar_core.cli.prompt_input import Prompt

    prompts, rows = [Prompt("--prompt 1", text="the")], [{"finish": "eos", "generated_ids": [first]}]
    assert _chat_hint(prompts, rows, tokenizer(), chat=False) is not None  # the same rows without --chat: a hint
    assert _chat_hint(prompts, rows, tokenizer(), chat=True) is None
    out, err = run_text(capsys, str(d), "--ids", "--prompt", f"{BOS} {THE}", "--max-new-tokens", "2")
    assert "(finish: eos, 1 token)" in out and "hint" not in err  # token ids are not text
    out, err = run_text(capsys, str(d), "--prompt", "the", "--max-new-tokens", "2", "--ignore-eos")
    assert "(finish: length, 2 tokens)" in out and "hint" not in err
    plain = without_chat_template(d, tmp_path / "plain")
    out, err = run_text(capsys, str(plain), "--prompt", "the", "--max-new-tokens", "2")
    assert "(finish: eos, 1 token)" in out and "hint" not in err


def test_the_progress_line_ends_on_the_tokens_generated(ends_at_once, capsys, monkeypatch):
    from mstar_core.cli import generate

    d, _ = ends_at_once
    monkeypatch.setattr(generate, "PROGRESS_EVERY_S", 0.0)  # a line after every step
    assert main(["generate", str(d), "--prompt", "the", "--prompt", "the cat sat", "--max-new-tokens", "6",
                 "--json"]) == 0
    got = capsys.readouterr()
    out = json.loads(got.out)
    lines = [x for x in got.err.splitlines() if x.startswith("mstar generate:") and "hint" not in x]
    assert out["prompts"][0]["finish"] == "eos" and out["new_tokens"] < 12  # prompt 0 ended at once
    assert len(lines) >= 2 and all(" of at most 12, " in x for x in lines[:-1])  # the total: an upper bound
    assert re.fullmatch(rf"mstar generate: done, {out['new_tokens']} tokens generated in \d+ s", lines[-1])


def test_a_cut_at_the_very_start_leaves_no_text():
    from mstar_core.integrations.transformers.text import StopStrings

    assert StopStrings(tokenizer(), ["the"]).cut("the cat") == ("", True)
    assert StopStrings(tokenizer(), ["dog"]).cut("the cat") == ("the cat", False)


@pytest.mark.parametrize("stops", [[], ["cat", ""], ["cat", 3], [""]], ids=["none", "empty", "not-text", "only-empty"])
def test_stop_strings_must_be_non_empty_text(stops):
    from mstar_core.errors import InputError
    from mstar_core.integrations.transformers.text import StopStrings

    with pytest.raises(InputError, match="--stop takes non-empty strings"):
        StopStrings(tokenizer(), stops)


def test_the_tail_checked_covers_the_longest_stop_string():
    from mstar_core.integrations.transformers.text import StopStrings

    long = "the cat sat on the cat sat on"  # eight tokens, completed by the last
    stop = StopStrings(tokenizer(), ["mat", long])
    assert stop(0, [BOS, THE, CAT, SAT, ON, THE, CAT, SAT, ON])
    assert not stop(0, [BOS, CAT, SAT, ON, THE, CAT, SAT, ON])


def test_a_chat_template_that_fails_is_reported_naming_the_prompt_and_the_error():
    from mstar_core.errors import InputError
    from mstar_core.integrations.transformers.text import encode_chat

    refusing = tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InputError, match=r"prompt 2: the tokenizer's chat template fails .*roles must alternate"):
        encode_chat(refusing, [{"role": "user", "content": "the cat"}], "prompt 2")
