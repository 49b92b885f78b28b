"""The attention function transformers calls under ``attn_implementation="mstar"``.

It is a plain function of what a transformers attention module hands it (``query [1, Hq, T, D]``
after RoPE, ``key``/``value [1, Hkv, T, D]`` of this step's packed tokens, and the module's
``scaling``, ``sliding_window``, ``softcap``, ``s_aux`` keywords): it translates them to the
core's layout and hands them to whatever is bound for the forward in progress (a
:class:`Binding`: the engine's KV cache and attention manager, or the probe that reads what each
layer asks for). Outside such a forward there is no KV cache to attend over, and it says so
instead of computing something else.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from mstar_core.errors import InputError, StateError

NAME = "mstar"
BINDING_KWARG = "mstar_binding"  # the keyword a compiled forward passes its binding by


class Binding(Protocol):
    """What a forward in progress hands the layers (the engine, or the probe)."""

    def attend(self, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
               kwargs: dict[str, Any]) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` -> ``[T, Hq, D]``."""
        ...


_BOUND: contextvars.ContextVar[Binding | None] = contextvars.ContextVar("mstar_binding", default=None)


@contextmanager
def bound(binding: Binding) -> Iterator[None]:
    """Layers called inside attend through ``binding``."""
    token = _BOUND.set(binding)
    try:
        yield
    finally:
        _BOUND.reset(token)


def mstar_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ``([1, T, Hq, D], None)`` (no weights).
    A compiled forward passes its binding as the keyword ``mstar_binding`` (transformers hands a
    model's keywords down to its attention calls): a context variable cannot be traced."""
    b = kwargs.pop(BINDING_KWARG, None)
    if b is None and torch.compiler.is_compiling():
        raise StateError(f"mstar attention under torch.compile: pass the binding as the model call's keyword "
                         f"{BINDING_KWARG}= (the Engine does), since a context variable cannot be traced")
    b = b if b is not None else _BOUND.get()
    if b is None:
        raise StateError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) runs with attn_implementation "
            f"{NAME!r}, whose K/V live in mstar's paged cache: run the model through "
            "mstar_core.integrations.transformers.generate (or Engine), or switch it back with "
            "model.set_attn_implementation('sdpa') for a plain forward")
    if query.shape[0] != 1:
        raise InputError(f"mstar attention takes the step's tokens packed in one row (batch 1), got a batch of "
                         f"{query.shape[0]}; mstar's generate packs requests itself")
    # [1, H, T, D] -> [T, H, D]: transformers transposed a [1, T, H, D] projection, so this is
    # contiguous again in the common case (contiguous() is then free).
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    o = b.attend(module, q, k, v, attention_mask, kwargs)
    return o.unsqueeze(0), None


def register() -> None:
    """Register :func:`mstar_attention` with transformers' ``AttentionInterface`` under
    ``"mstar"``. No mask function is registered on purpose: transformers then builds no mask
    for this name (the plan carries causality and windows), so a packed step costs no
    ``tokens x tokens`` tensor."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, mstar_attention)
