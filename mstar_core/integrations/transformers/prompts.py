"""The checks ``generate`` applies to its prompts and token budget where they enter."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar_core.errors import InputError
from mstar_core.step import is_int


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int | None) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InputError("generate: prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not p:
            raise InputError(f"generate: prompts[{i}] must be a non-empty list of token ids, got {p!r:.60}")
        ids = [int(t) for t in p]
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise InputError(f"generate: prompts[{i}] has token ids {bad[:5]} outside the vocabulary 0..{vocab}")
        out.append(ids)
    return out


def check_max_new(max_new_tokens: object) -> None:
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
