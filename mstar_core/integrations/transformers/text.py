"""Text in and out of a transformers tokenizer: prompts to ids (plain text with the special
tokens the tokenizer adds, chats through its chat template), generated ids to text, and stop
strings checked as tokens arrive."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mstar_core.errors import InputError

# Tokens decoded beyond a stop string's byte length when checking the tail: the first may be
# half of a multi-byte character, and skipped special tokens decode to nothing.
STOP_MARGIN = 4


def _said(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``text`` with the special tokens the tokenizer adds by default (a BOS, for most)."""
    return list(tokenizer(text)["input_ids"])


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]], where: str) -> list[int]:
    """``messages`` through the tokenizer's chat template, ending with the assistant's turn
    opened; the template writes its own BOS, so none is added on top."""
    try:
        enc = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    except Exception as e:  # jinja raises its own types, and templates raise on roles they refuse
        raise InputError(f"generate: {where}: the tokenizer's chat template fails on these messages "
                         f"({_said(e)})") from e
    return list(enc["input_ids"])


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of generated ids, without special tokens (end-of-sequence, chat markers)."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))


class StopStrings:
    """``stop(index, ids)`` for ``generate``: True once the text of ``ids`` holds a stop string.
    Only the tail is decoded (a stop string is found at the token that completes it), so each
    call costs a few tokens' decode whatever the output's length."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise InputError(f"generate: --stop takes non-empty strings, got {list(stops)!r}")
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + STOP_MARGIN

    def __call__(self, index: int, ids: Sequence[int]) -> bool:
        tail = decode(self.tokenizer, ids[-self.window:])
        return any(s in tail for s in self.stops)

    def cut(self, text: str) -> tuple[str, bool]:
        """``text`` up to its first stop string, and whether one was found."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return (text[: min(found)], True) if found else (text, False)
