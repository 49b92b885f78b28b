"""The prompts of ``mstar generate``, read and checked before any model file is opened:
``--prompt`` values and ``--prompt-file`` files (plain text, one prompt a line, or JSONL).

Text is always text; token ids only under ``--ids`` (or a JSONL line's ``"ids"``), so a prompt
such as ``"2024"`` is never read as an id."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mstar_core.errors import InputError
from mstar_core.text_files import read_text

JSONL_KEYS = ("prompt", "messages", "ids")  # exactly one per line


@dataclass(frozen=True)
class Prompt:
    """One request's input: text, a chat (``messages``) or token ids; ``where`` names its source
    in error messages (``--prompt 2``, ``FILE line 3``)."""

    where: str
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    ids: list[int] | None = None


def parse_ids(text: str, where: str) -> list[int]:
    """``"1,2,3"`` or ``"1 2 3"`` as ints (range checks come with the model's vocabulary)."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise InputError(f"generate: {where}: no token ids (with --ids a prompt is ids such as \"1,2,3\" or \"1 2 3\")")
    bad = [p for p in parts if not p.lstrip("-").isdigit()]
    if bad:
        raise InputError(f"generate: {where}: {bad[0]!r} is not a token id (with --ids a prompt is ids such as "
                         "\"1,2,3\" or \"1 2 3\"; leave out --ids for text)")
    return [int(p) for p in parts]


def _line_prompt(line: str, where: str, ids: bool) -> Prompt:
    return Prompt(where, ids=parse_ids(line, where)) if ids else Prompt(where, text=line)


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise InputError(f"generate: {where}: \"messages\" must be a non-empty list of objects with string \"role\" "
                         f"and \"content\", got {json.dumps(value)[:80]}")
    return value


def _jsonl_prompt(line: str, where: str) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"generate: {where}: not valid JSON (column {e.colno}: {e.msg})") from None
    if not isinstance(obj, dict):
        raise InputError(f"generate: {where}: each line must be a JSON object with one of {list(JSONL_KEYS)}, "
                         f"got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(JSONL_KEYS))
    given = [k for k in JSONL_KEYS if k in obj]
    if unknown or len(given) != 1:
        what = f"unknown keys {unknown}" if unknown else f"keys {given}" if given else "no prompt key"
        raise InputError(f"generate: {where}: {what}; each line holds exactly one of {list(JSONL_KEYS)}")
    value = obj[given[0]]
    if given[0] == "prompt":
        if not isinstance(value, str):
            raise InputError(f"generate: {where}: \"prompt\" must be a string, got {type(value).__name__}")
        return Prompt(where, text=value)
    if given[0] == "messages":
        return Prompt(where, messages=_messages(value, where))
    if not (isinstance(value, list) and value and all(type(t) is int for t in value)):
        raise InputError(f"generate: {where}: \"ids\" must be a non-empty list of integers, got "
                         f"{json.dumps(value)[:80]}")
    return Prompt(where, ids=value)


def read_prompt_file(path: str, ids: bool) -> list[Prompt]:
    """A ``.jsonl`` file: one JSON object a line (``{"prompt": TEXT}``, ``{"messages": [...]}`` or
    ``{"ids": [...]}``); any other file: one prompt a line (token ids with ``--ids``). Blank lines
    are skipped; a line's own spaces are kept."""
    p = Path(path)
    text = read_text(p, f"generate: --prompt-file {path!r}")
    jsonl = p.suffix.lower() == ".jsonl"
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            where = f"--prompt-file {path!r} line {n}"
            out.append(_jsonl_prompt(line, where) if jsonl else _line_prompt(line, where, ids))
    if not out:
        raise InputError(f"generate: --prompt-file {path!r} holds no prompts (blank lines are skipped)")
    return out


def gather(prompts: list[str] | None, files: list[str] | None, ids: bool) -> list[Prompt]:
    """Every ``--prompt`` in order, then every ``--prompt-file``'s prompts in order."""
    out = [_line_prompt(t, f"--prompt {i + 1}", ids) for i, t in enumerate(prompts or [])]
    for f in files or []:
        out.extend(read_prompt_file(f, ids))
    if not out:
        raise InputError("generate: no prompts: give --prompt TEXT (repeatable) or --prompt-file FILE")
    return out
