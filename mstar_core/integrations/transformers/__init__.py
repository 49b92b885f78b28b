"""Hugging Face transformers models through mstar (in a clone of mstar: ``pip install '.[transformers]'``).

Importing this package imports transformers and registers the attention function ``"mstar"``
with its ``AttentionInterface``; the rest of mstar never imports transformers.

>>> from mstar_core.integrations.transformers import generate
>>> ids = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32)            # doctest: +SKIP

:func:`generate` switches the model to ``attn_implementation="mstar"`` (and back), checks what
its layers ask for (:func:`probe`: soft-cap, sink logits, sliding windows, scaling; what no
backend can serve is refused naming the feature), picks the backend, and serves the prompts
greedily with continuous batching; on CUDA decode steps replay CUDA graphs and the next step is
planned while one runs. :class:`Engine` and :func:`run` are the same in two parts, for callers
that build once and generate several times (benchmarks).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from mstar_core.distributed import TensorParallel
from mstar_core.errors import InputTypeError
from mstar_core.integrations.transformers.attention import NAME, mstar_attention, register
from mstar_core.integrations.transformers.batching import run, run_checked
from mstar_core.integrations.transformers.engine import Engine, EngineOptions, check_model
from mstar_core.integrations.transformers.generation import Generation, StepRecord
from mstar_core.integrations.transformers.probe import LayerAttention, ModelAttention, UnsupportedModel, probe
from mstar_core.integrations.transformers.prompts import (
    check_arrivals,
    check_eos,
    check_length,
    check_max_new,
    check_on_step,
    check_prompts,
    check_stop,
)
from mstar_core.kv.paged import pages_for
from mstar_core.sampling import SamplingParams, check_sampling

log = logging.getLogger(__name__)

__all__ = [
    "NAME", "Engine", "EngineOptions", "Generation", "LayerAttention", "ModelAttention", "StepRecord",
    "UnsupportedModel", "generate", "generate_report", "mstar_attention", "probe", "register", "run",
]

RUN_OPTIONS = ("arrivals", "eos_token_id", "on_step", "sampling", "stop")
ENGINE_OPTIONS = tuple(f.name for f in fields(EngineOptions))

register()


def generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             backend: str | Mapping[str, str] | None = None, tp: int | TensorParallel | None = None,
             **options: Any) -> list[list[int]]:
    """Generation through mstar: ``prompts`` are token-id lists; returns each prompt's new token
    ids (stopping after the model's end-of-sequence token, which is kept, as ``model.generate``
    does). ``backend``: a name or ``"auto"``, or capability -> name (``"default"``: the others;
    each paged capability from its own pick) (None: config, env, then auto). Greedy unless
    ``sampling`` says otherwise.

    ``options``: :class:`EngineOptions` fields (``page_size``, ``max_pages`` (default: room for
    every prompt at once), ``max_batch_size``, ``max_prefill_tokens``, ``graphs``, ``buckets``,
    ``kv_dtype``, ``compile``, ``sampler`` filters (default: what the requests need),
    ``prefix_cache`` (prompts that share a prefix share its pages; the report's
    ``cached_tokens`` and ``prefix_hit_rate`` say what was found), ``tp_timeout_s``) and
    ``sampling`` (a :class:`~mstar_core.sampling.SamplingParams`, or one per prompt),
    ``arrivals`` (the step each prompt joins at), ``eos_token_id`` (default the model's
    generation config's; None to never stop early), ``on_step(done, total)``,
    ``stop(i, ids) -> bool`` (after each new token of prompt ``i``; True ends it there).

    ``tp``: tensor parallelism, every rank calling this with the same prompts (torchrun): None
    serves the model as it is sharded (``from_pretrained(..., distributed_config=
    DistributedConfig(tp_size=N))``) or on one process; a rank count (or a
    :class:`~mstar_core.distributed.TensorParallel`) shards a model every rank holds whole, in
    place, by its ``tp_plan``. Every rank returns the same ids (checked)."""
    return generate_report(model, prompts, max_new_tokens, backend, tp, **options).ids


def generate_report(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    backend: str | Mapping[str, str] | None = None, tp: int | TensorParallel | None = None,
                    **options: Any) -> Generation:
    """:func:`generate`, returning the :class:`Generation` (ids, steps, timings)."""
    unknown = sorted(set(options) - set(RUN_OPTIONS) - set(ENGINE_OPTIONS))
    if unknown:
        raise InputTypeError(f"generate got unknown options {unknown}; "
                             f"it accepts {sorted(ENGINE_OPTIONS + RUN_OPTIONS)}")
    # Refused before the engine is built (probing and graph capture are not free).
    check_model(model)
    check_max_new(max_new_tokens)
    vocab = getattr(model.config, "vocab_size", None)
    prompts = check_prompts(prompts, vocab)
    check_length(prompts, max_new_tokens, model.config)
    run_kw = {k: options.pop(k) for k in RUN_OPTIONS if k in options}
    if "eos_token_id" not in run_kw:
        gen = getattr(model, "generation_config", None)
        run_kw["eos_token_id"] = _model_eos(getattr(gen, "eos_token_id", None), vocab)
    eos = check_eos(run_kw["eos_token_id"], vocab)
    arrivals = check_arrivals(run_kw.get("arrivals"), len(prompts))
    on_step, stop = run_kw.get("on_step"), run_kw.get("stop")
    check_on_step(on_step)
    check_stop(stop)
    sampling = check_sampling(run_kw.get("sampling"), len(prompts))
    options.setdefault("sampler", _filters(sampling))
    engine_opts = _sized(prompts, max_new_tokens, options)
    with Engine(model, backend, engine_opts, tp) as engine:
        return run_checked(engine, prompts, max_new_tokens, arrivals, eos, on_step, sampling, stop)


def _filters(sampling: list[SamplingParams]) -> tuple[str, ...] | None:
    """The sampler these requests need: None where every one is plain greedy (an argmax)."""
    if not any(p.needs_sampler for p in sampling):
        return None
    return tuple(sorted(set().union(*(p.filters() for p in sampling))))


def _model_eos(eos: Any, vocab: int | None) -> Any:
    """The model's own end-of-sequence ids, less any its vocabulary cannot produce (a config may
    list one; it would never match): those are dropped with a warning, not refused."""
    ids = sorted(check_eos(eos, None))
    keep = [t for t in ids if vocab is None or t < vocab]
    if len(keep) < len(ids):
        log.warning("the model's generation config lists end-of-sequence ids %s outside its vocabulary of %d: "
                    "they can never be produced and are ignored", [t for t in ids if t not in keep], vocab)
        return keep
    return eos


def _sized(prompts: list[list[int]], max_new_tokens: int, options: dict[str, Any]) -> EngineOptions:
    """The caller's options, with what they leave out sized for these prompts: pages for all of
    them at once, a batch of all of them (at most 64), a step budget that fits the longest."""
    o = dict(options)
    lengths = [len(p) for p in prompts]
    o.setdefault("max_batch_size", min(64, len(prompts)))
    ps = o.get("page_size", EngineOptions.page_size)
    if isinstance(ps, int) and ps >= 1:
        need = sum(pages_for(m + max_new_tokens, ps) for m in lengths)
        # + the graph warm-up's dummy rows (one page each, given back before any request joins)
        o.setdefault("max_pages", max(need, o["max_batch_size"]) + 1)
    o.setdefault("max_prefill_tokens", max([EngineOptions.max_prefill_tokens, *lengths]))
    return EngineOptions(**o)
