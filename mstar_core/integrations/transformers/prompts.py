"""The checks ``generate`` applies where its inputs enter: prompts, token budget and the model's
positions, arrivals, end-of-sequence ids and callbacks. Ints are ints
(:func:`~mstar_core.step.is_int`): ``1.9``, ``"1"`` or ``True`` are refused, never rounded or
parsed."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import torch

from mstar_core.errors import InputError, InputTypeError
from mstar_core.step import elements, is_int


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int | None,
                  names: Sequence[str] | None = None) -> list[list[int]]:
    """Plain lists of ints; a tensor or numpy array (a 2-D one for every prompt, or one per
    prompt) is read with ``tolist``, so its dtype decides whether the ids are ints. ``names``:
    what messages call each prompt (default ``prompts[i]``; the CLI names flags and lines)."""
    prompts = elements(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InputError(f"generate: prompts must be a non-empty list of token-id lists, got {prompts!r:.60}")
    out = []
    for i, p in enumerate(prompts):
        p = elements(p)
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not p:
            raise InputError(f"generate: prompts[{i}] must be a non-empty list of token ids, got {p!r:.60}")
        notint = [t for t in p if not is_int(t)]
        if notint:
            raise InputTypeError(f"generate: prompts[{i}] holds {_show(notint)}: token ids must be ints")
        ids = [int(t) for t in p]  # a numpy integer becomes a plain int
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise InputError(f"generate: {_name(names, i)} has token ids {bad[:5]} outside {_vocab(vocab)}")
        out.append(ids)
    return out


def check_length(prompts: list[list[int]], max_new_tokens: int, config: object,
                 names: Sequence[str] | None = None, option: str = "max_new_tokens") -> None:
    """Every prompt and its new tokens within the model's ``max_position_embeddings`` (the longest
    sequence it was built for), refused before any cache is sized for it. ``option``: what the
    message calls ``max_new_tokens``."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config  # a multimodal config keeps its text model's
    limit = getattr(text, "max_position_embeddings", None)
    if not is_int(limit) or limit < 1:
        return
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    n = len(prompts[longest])
    if n + max_new_tokens > limit:
        fix = f"lower {option} to at most {limit - n}" if n < limit else "shorten the prompt"
        raise InputError(f"generate: {_name(names, longest)} ({n} tokens) + {option} {max_new_tokens} = "
                         f"{n + max_new_tokens} positions, more than the model's max_position_embeddings {limit}: "
                         f"{fix}")


def check_stop(stop: object) -> None:
    if stop is not None and not callable(stop):
        raise InputTypeError(f"generate: stop must be a callable stop(index, ids) -> bool or None, got {stop!r:.60}")


def check_max_new(max_new_tokens: object) -> None:
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")


def check_arrivals(arrivals: Sequence[int] | None, count: int) -> list[int]:
    """One arrival step >= 0 per prompt (None: all at step 0)."""
    if arrivals is None:
        return [0] * count
    arrivals = elements(arrivals)
    if isinstance(arrivals, (str, bytes)) or not isinstance(arrivals, Sequence) or len(arrivals) != count \
            or any(not is_int(a) or a < 0 for a in arrivals):
        raise InputError(f"generate: arrivals must give one step (an int >= 0) per prompt ({count}), "
                         f"got {arrivals!r:.80}")
    return [int(a) for a in arrivals]


def check_eos(eos_token_id: object, vocab: int | None) -> set[int]:
    """The end-of-sequence ids: None (never stop early), an int, a sequence or set of ints, or an
    integer tensor or numpy array (a 0-d one too)."""
    if eos_token_id is None:
        return set()
    value = eos_token_id
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise InputTypeError(f"generate: eos_token_id must hold integer ids, got a {value.dtype} tensor")
        value = value.reshape(-1).tolist()
    value = elements(value)  # a numpy array (a numpy integer stays one: is_int takes it)
    if isinstance(value, AbstractSet):
        value = sorted(value, key=repr)
    ids = [value] if is_int(value) else value
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or any(not is_int(t) for t in ids):
        raise InputTypeError(f"generate: eos_token_id must be None, an int or a list of ints, got {eos_token_id!r:.60}")
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise InputError(f"generate: eos_token_id {bad[:5]} outside {_vocab(vocab)}")
    return {int(t) for t in ids}


def _show(values: Sequence[object]) -> str:
    return ", ".join(f"{v!r} ({type(v).__name__})" for v in values[:3]) + (" ..." if len(values) > 3 else "")


def check_on_step(on_step: object) -> None:
    if on_step is not None and not callable(on_step):
        raise InputTypeError(f"generate: on_step must be a callable on_step(done, total) or None, got {on_step!r:.60}")


def _name(names: Sequence[str] | None, i: int) -> str:
    return f"prompts[{i}]" if names is None else names[i]


def _vocab(vocab: int | None) -> str:
    return "the token ids (>= 0)" if vocab is None else f"the vocabulary (ids 0..{vocab - 1})"
