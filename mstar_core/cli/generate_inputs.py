"""``mstar generate``'s checks before the weights load: flags that go together, sampling flags
as :class:`~mstar_core.sampling.SamplingParams`, prompts encoded with the tokenizer, and their
ids and lengths against the model's config."""

from __future__ import annotations

import argparse
from typing import Any

from mstar_core.cli.options import check_compile
from mstar_core.cli.prompt_input import Prompt
from mstar_core.errors import InputError, InputTypeError

# flag attribute -> SamplingParams field (the seed is --sampling-seed plus the prompt's index)
SAMPLING_FLAGS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty"}
SEED_LIMIT = 1 << 63


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_flags(args: argparse.Namespace) -> None:
    """Flags that do not go together, and sizes that must be >= 1."""
    if args.max_new_tokens < 1:
        raise InputError(f"generate: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for name in ("batch_size", "page_size", "max_pages"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"generate: {_flag(name)} must be >= 1, got {value}")
    if args.system is not None and not args.chat:
        raise InputError("generate: --system is a chat's system message: give --chat with it")
    if args.chat and args.ids:
        raise InputError("generate: --chat puts text prompts through the chat template, --ids says the prompts are "
                         "token ids: give one of them")
    if args.stop and any(not s for s in args.stop):
        raise InputError("generate: --stop takes a non-empty string")
    sampling_from(args, 1)  # its values refused now, not after the weights load
    check_compile(args, "generate")


def sampling_from(args: argparse.Namespace, count: int) -> list[Any] | None:
    """One ``SamplingParams`` per prompt from the sampling flags (None when none is given):
    prompt ``i`` gets seed ``--sampling-seed + i``."""
    from mstar_core.sampling import SamplingParams

    given = {field: getattr(args, flag) for flag, field in SAMPLING_FLAGS.items() if getattr(args, flag) is not None}
    seed = args.sampling_seed
    if not given and seed is None:
        return None
    if seed is not None and not 0 <= seed <= SEED_LIMIT - count:
        raise InputError(f"generate: --sampling-seed must be in 0..2**63-{count} (prompt i draws with seed S+i, "
                         f"{count} prompts), got {seed}")
    try:
        return [SamplingParams(**given, seed=None if seed is None else seed + i) for i in range(count)]
    except (InputError, InputTypeError) as e:
        field = str(e).split(": ", 1)[-1].split()[0]  # "SamplingParams: top_p must be ..."
        flag = next((f for f, v in SAMPLING_FLAGS.items() if v == field), field)
        raise InputError(f"generate: {_flag(flag)} {given.get(field)!r}: {str(e).split(': ', 1)[-1]}") from None


def _chat(p: Prompt, system: str | None) -> list[dict[str, str]]:
    messages = p.messages if p.messages is not None else [{"role": "user", "content": p.text or ""}]
    if system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def encode_all(prompts: list[Prompt], tokenizer: Any, source: Any, chat: bool, system: str | None) -> list[list[int]]:
    """Each prompt's ids: token ids as given, text through the tokenizer (with ``chat``, or for
    ``messages``, through its chat template)."""
    from mstar_core.integrations.transformers.text import encode_chat, encode_text, has_chat_template

    out = []
    for p in prompts:
        if p.ids is not None:
            out.append(p.ids)
            continue
        if tokenizer is None:
            raise InputError(f"generate: {p.where} is text, and {source.where()} has no tokenizer: give token ids "
                             "with --ids (\"1,2,3\")")
        templated = chat or p.messages is not None
        if templated and not has_chat_template(tokenizer):
            asks = "--chat" if chat else 'a "messages" line'
            raise InputError(f"generate: {p.where}: {asks} needs a chat template, and the tokenizer of "
                             f"{source.where()} has none")
        ids = encode_chat(tokenizer, _chat(p, system), p.where) if templated else encode_text(tokenizer, p.text or "")
        if not ids:
            raise InputError(f"generate: {p.where}: the text encodes to no tokens")
        out.append(ids)
    return out


def check_fits(prompts: list[Prompt], ids: list[list[int]], config: Any, max_new: int) -> None:
    """Ids inside the vocabulary, and each prompt plus ``--max-new-tokens`` inside the model's
    positions: ``generate``'s own checks, run on the config before the weights load."""
    from mstar_core.integrations.transformers.prompts import check_length, check_prompts

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    names = [p.where for p in prompts]
    check_prompts(ids, getattr(text_config, "vocab_size", None), names)
    check_length(ids, max_new, config, names, "--max-new-tokens")  # it reads the text config itself
