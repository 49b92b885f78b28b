"""What a transformers model's attention asks for, read from the model itself: one forward of two
tokens with a recording binding, so each layer reports the shapes and keywords it really passes
(``scaling``, ``sliding_window``, ``softcap``, ``s_aux``) instead of a per-architecture table.

What mstar cannot serve is refused here, before anything is built, with an error that names the
feature: cross-attention, bidirectional layers, K and V of different head dims (MLA), a mask the
model builds itself, keywords whose meaning mstar does not know, and values that differ per layer
where mstar plans one per step (``sm_scale``, soft-cap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mstar_core.errors import UnsupportedModel
from mstar_core.features import AttentionFeatures
from mstar_core.integrations.transformers.attention import bound

# Keywords transformers passes along that do not change the attention math (or that mstar
# takes care of itself): anything else with a value is refused rather than ignored.
HARMLESS_KWARGS = frozenset({
    "dropout", "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "is_causal", "layer_idx", "past_key_values", "cache", "position_embeddings",
    "output_router_logits",  # a mixture-of-experts flag passed down every layer
})
# What this module maps to mstar, by transformers' keyword name.
MAPPED_KWARGS = frozenset({"scaling", "sliding_window", "softcap", "s_aux"})


@dataclass(frozen=True)
class LayerAttention:
    """One attention layer as it called the attention function."""

    layer: int
    qo_heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    window_left: int  # -1: full attention; else transformers' sliding_window - 1
    soft_cap: float | None
    sinks: bool

    @property
    def args(self) -> tuple[float, int, float | None, bool]:
        """What :func:`attention_args` read from the call."""
        return (self.scaling, self.window_left, self.soft_cap, self.sinks)


@dataclass(frozen=True)
class ModelAttention:
    """Every attention layer of a model, and what mstar builds for them."""

    model: str
    layers: tuple[LayerAttention, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def qo_heads(self) -> int:
        return self.layers[0].qo_heads

    @property
    def kv_heads(self) -> int:
        return self.layers[0].kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @property
    def sm_scale(self) -> float:
        return self.layers[0].scaling

    def features(self, kv_dtype: str = "auto") -> AttentionFeatures:
        windows = tuple(layer.window_left for layer in self.layers)
        sinks = tuple(layer.sinks for layer in self.layers)
        return AttentionFeatures(
            kv_dtype=kv_dtype, soft_cap=self.layers[0].soft_cap, sink_logits=sinks if len(set(sinks)) > 1 else sinks[0],
            layer_windows=None if set(windows) == {-1} else windows,
        )

    def describe(self) -> str:
        windows = sorted({x.window_left for x in self.layers})
        return (f"{self.model}: {len(self.layers)} attention layers, {self.qo_heads} query / {self.kv_heads} KV heads, "
                f"head dim {self.head_dim}, sm_scale {self.sm_scale:.4g}, window_left {windows}, "
                f"{self.features()}")


def attention_args(q: torch.Tensor, kwargs: dict[str, Any]) -> tuple[float, int, float | None, bool]:
    """``(sm_scale, window_left, soft_cap, sinks)`` of one attention call's keywords, as mstar
    plans them (the probe records them; the engine checks every later call against them)."""
    scaling, window, cap = kwargs.get("scaling"), kwargs.get("sliding_window"), kwargs.get("softcap")
    return (q.shape[-1] ** -0.5 if scaling is None else float(scaling), -1 if window is None else int(window) - 1,
            None if cap is None else float(cap), kwargs.get("s_aux") is not None)


class _Recorder:
    """The probing binding: records each layer's call and answers zeros (the values of later
    layers do not matter, only what they pass)."""

    def __init__(self) -> None:
        self.calls: dict[int, LayerAttention] = {}
        self.problems: dict[str, list[int]] = {}  # what is wrong -> the layers it is wrong in

    def _problem(self, layer: int, what: str) -> None:
        self.problems.setdefault(what, []).append(layer)

    def attend(self, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
               kwargs: dict[str, Any]) -> torch.Tensor:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            layer = -1 - len(self.calls)
            self._problem(layer, f"{type(module).__name__} has no integer layer_idx (mstar indexes its KV cache by it)")
        if k.shape[0] != q.shape[0] or getattr(module, "is_cross_attention", False):
            self._problem(layer, "cross-attention (keys from another sequence) is not supported by mstar")
        if getattr(module, "is_causal", True) is False:
            self._problem(layer, "bidirectional (non-causal) attention is not supported by mstar")
        if k.shape[-1] != q.shape[-1] or v.shape[-1] != k.shape[-1]:
            self._problem(layer, f"query/key/value head dims {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} differ "
                                 "(multi-head latent attention, MLA): mstar's caches hold K and V of one head dim")
        if mask is not None:
            self._problem(layer, f"the model builds its own attention mask ({type(mask).__name__}); mstar "
                                 "takes causality and windows from its plan and cannot apply a custom mask")
        unknown = sorted(n for n, x in kwargs.items()
                         if x is not None and n not in HARMLESS_KWARGS and n not in MAPPED_KWARGS)
        if unknown:
            self._problem(layer, f"attention keywords mstar does not know {unknown} (it understands "
                                 f"{sorted(MAPPED_KWARGS)}); refusing rather than ignoring them")
        sinks = kwargs.get("s_aux")
        if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
            self._problem(layer, f"s_aux (sink logits) has shape {tuple(sinks.shape)}, mstar takes one per "
                                 f"query head ({q.shape[1]},)")
        self.calls[layer] = LayerAttention(layer, q.shape[1], k.shape[1], q.shape[-1], *attention_args(q, kwargs))
        return q.new_zeros(*q.shape[:2], v.shape[-1])  # the output has the values' head dim (MLA: not the queries')


def _span(layers: list[int]) -> str:
    if len(layers) == 1:
        return f"layer {layers[0]}"
    run = layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2
    return "layers " + (f"{layers[0]}..{layers[-1]}" if run else ", ".join(map(str, layers)))


def refuse_config(model: Any) -> None:
    """What the config alone says mstar cannot serve (checked before the model is switched)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModel(f"{name} is not a transformers PreTrainedModel (no config / set_attn_implementation)")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{name} is an encoder-decoder model: cross-attention is not supported by mstar "
                               "(decoder-only causal LMs are)")


def probe(model: Any) -> ModelAttention:
    """Run ``model`` over two tokens with the recording binding and check what its layers ask
    for. The model must already use ``attn_implementation="mstar"``. Raises
    :class:`UnsupportedModel` naming every problem found."""
    name = type(model).__name__
    refuse_config(model)
    param = next(model.parameters())
    rec = _Recorder()
    ids = torch.zeros(1, 2, dtype=torch.long, device=param.device)
    with torch.no_grad(), bound(rec):
        model(input_ids=ids, position_ids=torch.arange(2, device=param.device)[None], use_cache=False)
    if not rec.calls:
        raise UnsupportedModel(f"{name} called no attention function under attn_implementation 'mstar' (an "
                               "architecture whose layers do not go through transformers' AttentionInterface)")
    layers = tuple(rec.calls[i] for i in sorted(rec.calls))
    problems = [f"{what} ({_span(where)})" for what, where in rec.problems.items()]
    if [x.layer for x in layers] != list(range(len(layers))):
        problems.append(f"attention layers {[x.layer for x in layers]} are not numbered 0..{len(layers) - 1} "
                        "(a hybrid model with layers that are not attention); not supported by mstar")
    first = layers[0]
    for what, attr in (("query heads", "qo_heads"), ("KV heads", "kv_heads"), ("head dim", "head_dim")):
        values = sorted({getattr(x, attr) for x in layers})
        if len(values) > 1:
            problems.append(f"{what} differ per layer ({values}); mstar's KV cache holds one shape for all layers")
    if any(not math.isclose(x.scaling, first.scaling, rel_tol=1e-6) for x in layers):
        problems.append(f"sm_scale differs per layer ({sorted({x.scaling for x in layers})}); mstar plans one per step")
    if len({x.soft_cap for x in layers}) > 1:
        problems.append(f"soft-cap differs per layer ({sorted({str(x.soft_cap) for x in layers})}); mstar takes one "
                        "for all layers")
    if first.qo_heads % first.kv_heads:
        problems.append(f"{first.qo_heads} query heads are not a multiple of {first.kv_heads} KV heads")
    if problems:
        raise UnsupportedModel(f"{name} cannot run with attn_implementation 'mstar': " + "; ".join(problems)
                               + " (mstar serves decoder-only causal self-attention; docs/TRANSFORMERS.md "
                               "lists what is served)")
    return ModelAttention(name, layers, param.dtype, param.device)
