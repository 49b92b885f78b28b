"""A transformers causal LM on mstar's resources: the paged KV cache and attention manager of the
backend picked for what the model's layers ask (:mod:`.probe`), the step runner with CUDA graphs
for decode steps, and the forward of one step's packed tokens.

The model is switched to ``attn_implementation="mstar"`` for the engine's life and back by
:meth:`Engine.close`. Every forward runs inside :func:`.attention.bound` with the engine as the
binding, so each layer's call writes its K/V once through the ``KVManager`` and runs the step's
plan (prefill, mixed or decode: one plan per step and distinct window) for its layer index.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import torch

from mstar_core.attention.paged import build_paged_attention, summary
from mstar_core.compiling import CompiledForward, compile_options
from mstar_core.config import load_config
from mstar_core.distributed import DEFAULT_TIMEOUT_S, TensorParallel
from mstar_core.errors import CompileError, InputError, InputTypeError, StateError
from mstar_core.graphs import GraphRunner, check_buckets
from mstar_core.integrations.transformers.attention import BINDING_KWARG, NAME, bound, register
from mstar_core.integrations.transformers.parallel import check_heads, compact_shards, group_for, per_rank, shard
from mstar_core.integrations.transformers.probe import (
    ModelAttention,
    UnsupportedModel,
    attention_args,
    probe,
    refuse_config,
)
from mstar_core.kv import KVConfig, KVManager
from mstar_core.memory import check_fits
from mstar_core.node import Node
from mstar_core.sampling import FILTERS, Sampler
from mstar_core.step import AttentionStep, StepContext, is_int, is_positive_finite

log = logging.getLogger(__name__)
LABEL = "text"


@dataclass(frozen=True)
class EngineOptions:
    """How the engine sizes mstar's resources. ``max_pages`` None: :func:`.generate` sizes the
    cache for its prompts. ``graphs`` None: on for CUDA (decode steps replay captured graphs and
    the next step is planned while one runs), off elsewhere."""

    max_pages: int | None = None
    page_size: int = 16
    max_batch_size: int = 64
    max_prefill_tokens: int = 8192  # prompt tokens admitted into one step (one prompt always fits)
    graphs: bool | None = None
    buckets: tuple[int, ...] | None = None  # graph batch sizes; None: powers of two up to max_batch_size
    kv_dtype: str = "auto"
    # The backend's name and pins from a config (a mapping or TOML file; mstar_core.config).
    config: Any = None
    # Graph steps run the model under torch.compile, compiled per bucket at warm-up: True (or fail),
    # None (where the model allows, else a warning), False. It turns the graph path on.
    compile: bool | None = False
    compile_backend: str = "inductor"
    # Tokens drawn on the device inside each step (:class:`~mstar_core.sampling.Sampler`) with these
    # filters of FILTERS (an empty tuple: temperature only); None: greedy argmax, no sampler.
    sampler: tuple[str, ...] | None = None
    # Requests that share a prompt prefix share its KV pages (KVManager(prefix_cache=True)); None:
    # as the config's [kv] prefix_cache says, off when it says nothing.
    prefix_cache: bool | None = None
    # Under tensor parallelism: a rank whose steps make no progress for this long (plus a grace)
    # ends itself instead of waiting forever on a failed peer (mstar_core.distributed.stall_guard).
    tp_timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("page_size", "max_batch_size", "max_prefill_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InputError(f"mstar generate: {name} must be an int >= 1, got {value!r}")
        if self.max_pages is not None and (not is_int(self.max_pages) or self.max_pages < 1):
            raise InputError(f"mstar generate: max_pages must be an int >= 1 (or None: sized for the prompts), "
                             f"got {self.max_pages!r}")
        if self.graphs is not None and not isinstance(self.graphs, bool):
            raise InputTypeError(f"mstar generate: graphs must be a bool or None (on for CUDA), got {self.graphs!r}")
        if self.buckets is not None:
            object.__setattr__(self, "buckets", check_buckets(self.buckets, "mstar generate"))
        compile_options(self.compile, self.compile_backend, "mstar generate")  # refused here, not at warm-up
        if self.sampler is not None:
            if isinstance(self.sampler, (str, bytes)) or not isinstance(self.sampler, (tuple, list, set, frozenset)) \
                    or set(self.sampler) - set(FILTERS):
                raise InputError(f"mstar generate: sampler must be None (greedy) or filters from {list(FILTERS)}, "
                                 f"got {self.sampler!r}")
            object.__setattr__(self, "sampler", tuple(sorted(self.sampler)))
        if self.prefix_cache is not None and not isinstance(self.prefix_cache, bool):
            raise InputTypeError(f"mstar generate: prefix_cache must be a bool or None (the config's), got "
                                 f"{self.prefix_cache!r}")
        if not is_positive_finite(self.tp_timeout_s):
            raise InputError(f"mstar generate: tp_timeout_s must be a finite number of seconds > 0, got "
                             f"{self.tp_timeout_s!r}")
        if self.compile is not False and self.graphs is False:
            raise InputError("mstar generate: compile compiles the graph steps (one graph per bucket), but graphs is "
                             "False; leave graphs at None (compile turns the graph path on) or True")

    def graph_buckets(self) -> list[int]:
        if self.buckets is not None:
            # A bucket wider than the batch is never filled: the widest becomes the batch itself
            # (generate sizes max_batch_size for its prompts, the buckets may be a generic list).
            return sorted({min(b, self.max_batch_size) for b in self.buckets})
        out, b = [], 1
        while b < self.max_batch_size:
            out.append(b)
            b *= 2
        return [*out, self.max_batch_size]


def graphs_default(device: torch.device) -> bool:
    """Graphs when the caller does not say: on CUDA (a replay is what makes decode fast), not
    elsewhere (on a CPU a "replay" re-runs the forward)."""
    return device.type == "cuda"


@dataclass
class _Switch:
    restore: str  # the implementation the model had before its first engine
    users: int = 0  # engines open on the model


# The models switched to mstar, with how many engines hold each switch: the last engine to close
# switches the model back, so closing one never pulls attention from under another still running.
_SWITCHES: weakref.WeakKeyDictionary[Any, _Switch] = weakref.WeakKeyDictionary()
_SWITCH_LOCK = threading.Lock()


def _output_width(model: Any) -> int:
    """The width of the model's logits (its LM head's rows; a config's vocab_size may be smaller)."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(model.config.vocab_size)


def model_identity(model: Any, dtype: torch.dtype) -> str:
    """What names the weights in the prefix cache's root: the class, where they came from, dtype."""
    c = type(model)
    return f"{c.__module__}.{c.__qualname__}:{getattr(model.config, '_name_or_path', '') or '?'}:{dtype}"


def check_model(model: Any) -> None:
    """Refuse what is not a transformers model (before anything else is asked of it)."""
    if getattr(model, "config", None) is None or not callable(getattr(model, "set_attn_implementation", None)):
        raise InputTypeError(f"{type(model).__name__} is not a transformers model (mstar serves a PreTrainedModel, "
                             "e.g. AutoModelForCausalLM.from_pretrained(...), which has .config and "
                             "set_attn_implementation)")


def switch(model: Any) -> None:
    """Switch ``model`` to ``attn_implementation="mstar"`` for one more user (the first switches,
    registering the function first; later ones share the switch). :func:`release` undoes it."""
    with _SWITCH_LOCK:
        held = _SWITCHES.get(model)
        if held is None:
            held = _SWITCHES[model] = _Switch(_switch_now(model))
        held.users += 1


def release(model: Any) -> None:
    """One user of :func:`switch` is done; the last one switches the model back to the
    implementation it had."""
    with _SWITCH_LOCK:
        held = _SWITCHES.get(model)
        if held is None:
            return
        held.users -= 1
        if held.users > 0:
            return
        del _SWITCHES[model]
        if held.restore != NAME and getattr(model.config, "_attn_implementation", None) == NAME:
            model.set_attn_implementation(held.restore)


def users(model: Any) -> int:
    """How many open engines hold ``model``'s switch."""
    held = _SWITCHES.get(model)
    return 0 if held is None else held.users


def _switch_now(model: Any) -> str:
    refuse_config(model)
    register()
    before = getattr(model.config, "_attn_implementation", None) or "eager"
    if before != NAME:
        try:
            model.set_attn_implementation(NAME)
        except (ValueError, KeyError, NotImplementedError) as e:
            raise UnsupportedModel(
                f"{type(model).__name__} does not take a custom attention implementation: {e}") from e
        # transformers only warns (and changes nothing) for a class it cannot switch.
        if getattr(model.config, "_attn_implementation", None) != NAME:
            raise UnsupportedModel(f"{type(model).__name__} did not switch to attn_implementation {NAME!r} "
                                   "(transformers refused it for this class): its attention does not go through "
                                   "AttentionInterface")
    return before


class Engine:
    """mstar's resources for one transformers model (see the module docstring). Build it, run
    :meth:`.batching.run` (or :func:`.generate`) over it, close it. Several engines may be open on
    one model (each with its own cache): they share its attention switch, which the last to close
    gives back. A closed engine refuses to run.

    ``tp``: the tensor-parallel ranks it runs over (every rank builds its own engine and runs the
    same requests): None, as the model is sharded (transformers' tensor parallelism) or on one
    rank; a rank count or a :class:`~mstar_core.distributed.TensorParallel`, whose group a whole
    model is sharded over in place (:func:`.parallel.shard`), once everything the whole model
    allows is checked and built. Each rank's KV cache holds its KV heads; after warm-up and at
    every step whose rows change the ranks check they admitted the same."""

    def __init__(self, model: Any, backend: str | Mapping[str, str] | None = None,
                 options: EngineOptions | None = None, tp: int | TensorParallel | None = None) -> None:
        check_model(model)
        o = options or EngineOptions()
        if not isinstance(o, EngineOptions):
            raise InputTypeError(f"Engine: options must be an EngineOptions, got {type(o).__name__}")
        if o.max_pages is None:
            raise InputError("Engine: options.max_pages is required (generate() sizes it for its prompts)")
        if getattr(model, "training", False):
            raise InputError("Engine: the model is in training mode (dropout); call model.eval() first")
        self.tp, must_shard = group_for(model, tp, "Engine")
        if self.tp is not None and not must_shard:  # sharded by transformers
            before, after = compact_shards(model)
            if after < before:
                log.info("rank %d: the model's weight shards were views of whole layers (transformers' sharded "
                         "loading); copied into storage of their own: %.1f MB -> %.1f MB", self.tp.rank, before / 1e6,
                         after / 1e6)
        self.model = model
        self.options = o
        self._nodes: list[Node] = []  # what close() cleans up (empty until built; once closed)
        self.closed = False
        self._switched = False
        switch(model)
        self._switched = True
        try:
            a = probe(model)
            if must_shard:  # what its layers will ask for once sharded, which is done last
                assert self.tp is not None
                a = per_rank(a, self.tp.world_size)
            else:
                check_heads(model, a.qo_heads, a.kv_heads, self.tp)
            self.attention: ModelAttention = a
            features = a.features(o.kv_dtype)
            self.device, self.dtype = a.device, a.dtype
            kvc = KVConfig(len(a.layers), a.kv_heads, a.head_dim, o.page_size, o.max_pages, a.qo_heads)
            # Refused before anything is allocated: a cache that does not fit would otherwise run
            # until the allocator fails, naming no option.
            check_fits(kvc.storage_bytes(features.kv_torch_dtype(self.dtype).itemsize), self.device,
                       f"Engine: the KV cache of max_pages {o.max_pages} x page_size {o.page_size} tokens "
                       f"({len(a.layers)} layers, {a.kv_heads} KV heads of {a.head_dim}; generate sizes max_pages "
                       "for its prompts and max_new_tokens)")
            prefix = o.prefix_cache if o.prefix_cache is not None else bool(load_config(o.config).prefix_cache)
            self.kv = KVManager(kvc, self.device, self.dtype, features=features, prefix_cache=prefix, tp=self.tp)
            compiling = compile_options(o.compile, o.compile_backend, "mstar generate")
            graphs = (graphs_default(self.device) or compiling is not None) if o.graphs is None else o.graphs
            widest = max(o.graph_buckets())
            if graphs and widest + 1 > o.max_pages:
                # The warm-up captures the widest bucket with one page per dummy row, besides the
                # page the KV manager keeps for padding rows' writes.
                why = (f"graphs capture batches of up to {widest} rows (max_batch_size {o.max_batch_size}, buckets "
                       f"{o.graph_buckets()}): {widest} pages and one for padding rows, but max_pages is {o.max_pages}")
                if o.graphs or o.compile:
                    raise InputError(f"Engine: {why}; raise max_pages, lower max_batch_size or buckets, or set "
                                     "graphs=False (and compile=False)")
                log.warning("graphs off: %s; every step runs eagerly%s", why, "" if compiling is None else
                            ", uncompiled")
                graphs, compiling = False, None
            # Selected per layer group: one manager where one selection serves every layer.
            self.attn = build_paged_attention(
                self.kv, self.device, self.dtype, kvc, backend, o.config, features, accelerator_graph=graphs,
                max_batch_size=o.max_batch_size, max_total_tokens=o.max_prefill_tokens + o.max_batch_size)
            self.backend = str(self.attn.backend_name)
            self.backends = dict(self.attn.backend_names)  # capability -> the backend(s) serving it
            if must_shard:
                # After every check the whole model allows (what its layers ask, the backend, the
                # cache): a failure before here leaves the caller's model whole.
                assert self.tp is not None
                shard(model, self.tp, "Engine")
                got = probe(model)
                check_heads(model, got.qo_heads, got.kv_heads, self.tp)
            log.info("%s on backend %s%s", a.describe(), summary(self.attn),  # describe() names the features
                     "" if self.tp is None else f"; rank {self.tp.rank} of {self.tp.world_size} (its heads)")
            self.node = Node([self.kv, self.attn])
            self._nodes.append(self.node)
            # What the prefix cache keys this engine's pages under (None: the cache is off): the
            # resources' fingerprints and the model's class, source and dtype.
            self.prefix_root = self.node.prefix_root(model_identity(model, self.dtype)) if prefix else None
            self.sampler = None if o.sampler is None else Sampler(
                self.device, o.max_batch_size, _output_width(model), o.sampler)
            # One sm_scale for every layer (the probe refuses a model whose layers differ).
            self.step_attn = AttentionStep(sm_scale=a.sm_scale)
            compiled = None if compiling is None else CompiledForward(
                self._graph_inputs, self._body, compiling, type(model).__name__)
            self.runner = GraphRunner(self.node, self._forward, o.graph_buckets(), self.device, LABEL,
                                      max_seq_len=o.max_pages * o.page_size, attn=self.step_attn, compiled=compiled)
            # What each layer passed when probed: a later call with other values would be served
            # with the wrong plan, so it is refused instead.
            self._expect = tuple(x.args for x in a.layers)
            with torch.no_grad():
                if graphs:
                    self._warmup(explicit=o.graphs is True or o.compile is True)
                else:
                    self.node.post_warmup_validate()
        except BaseException:
            self.close()
            raise

    def _warmup(self, explicit: bool) -> None:
        """Capture the decode graphs. A model whose forward cannot be captured (a host sync:
        e.g. a mixture-of-experts layer that looks up which experts were hit) runs eagerly when
        graphs were only the CUDA default, with a warning that says why; asked for explicitly, the
        error stands."""
        try:
            self.runner.warmup()
        except Exception as e:
            if explicit:
                raise
            log.warning("graphs off: capturing %s's decode step failed (%s: %s); every step runs eagerly",
                        self.attention.model, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.node.post_warmup_validate()  # the runner holds no graph and runs every step eagerly
            return
        if not self.runner.enabled:
            why = f"backend {self.backend} cannot capture paged decode here"
            if self.options.compile is True:  # compiling runs through the graph path, which is off
                raise CompileError(f"compile=True: {why}, and only graph steps are compiled; pick a backend that "
                                   "captures (mstar backends), or compile=None to run uncompiled where it cannot")
            log.warning("graphs requested but %s: steps run eagerly%s", why,
                        "" if self.runner.compiler is None else ", uncompiled")

    # -- the binding every layer calls ----------------------------------------------------------
    def attend(self, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
               kwargs: dict[str, Any]) -> torch.Tensor:
        i = module.layer_idx
        got = attention_args(q, kwargs)
        if mask is not None or got != self._expect[i]:
            raise UnsupportedModel(
                f"{type(module).__name__} layer {i} called attention with (sm_scale, window_left, soft_cap, sinks) = "
                f"{got}{' and a mask' if mask is not None else ''}; the engine was built for {self._expect[i]} "
                "(attention arguments must not change after the model is probed)")
        if self.attn.requires_kv_write:
            self.kv.write_kv(k, v, layer_idx=i, label=LABEL)
        return self.attn.run(q, LABEL, self.kv.layer_view(i), k=k, v=v, layer_idx=i, sinks=kwargs.get("s_aux"))

    def _forward(self, ctx: StepContext, tokens: torch.Tensor) -> torch.Tensor:
        """The next token of each row, ``[rows]``, from the logits of its last token (a graph
        step: every row is one token, padded to the bucket)."""
        self._check_switched()
        lay = ctx.plan_results[self.kv.name].layout(LABEL)
        keep: int | torch.Tensor = 0  # every token (one per row)
        positions = lay.positions
        if ctx.bucket is None and lay.num_tokens != len(lay.spans):
            # Prompt rows: only each row's last token reaches the LM head (a 512-token prompt's
            # full logits would be 512 x vocab).
            last = [s.q_start + s.to_compute - 1 for s in lay.spans]
            keep = torch.tensor(last, device=self.device)
            positions = positions[keep]
        with bound(self):
            out = self.model(input_ids=tokens[None], position_ids=lay.positions[None].long(), use_cache=False,
                             logits_to_keep=keep)
        return self._next_tokens(out.logits[0], positions)

    def _next_tokens(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Greedy argmax, or the sampler's draw: inside the step, so a graph replays it too."""
        if self.sampler is None:
            return logits.argmax(-1)
        return self.sampler.sample(logits, positions)

    def _check_switched(self) -> None:
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl != NAME:
            raise StateError(f"the model was switched to attn_implementation {impl!r} while an Engine is open on it "
                             f"(it would run without mstar's KV cache); switch it back once every engine is closed")

    def _graph_inputs(self, ctx: StepContext, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the compiled body of a graph step takes: its tokens and their positions."""
        self._check_switched()
        return tokens, ctx.plan_results[self.kv.name].layout(LABEL).positions

    def _body(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A graph step's next tokens ``[rows]`` from tensors alone (what ``torch.compile`` traces):
        the binding goes down as a keyword, and every row's one token reaches the LM head."""
        out = self.model(input_ids=tokens[None], position_ids=positions[None].long(), use_cache=False,
                         logits_to_keep=0, **{BINDING_KWARG: self})
        return self._next_tokens(out.logits[0], positions)

    def check_open(self) -> None:
        """Refuse to run a closed engine (its cache is freed; the model may run other attention)."""
        if self.closed:
            raise StateError("Engine is closed: its KV cache is freed and the model may be switched back; "
                             "build a new Engine to generate again")

    def close(self) -> None:
        """Free mstar's state and give back the model's attention switch (the last engine open on
        the model switches it back to the implementation it had). Closing twice does nothing."""
        self.closed = True
        try:
            runner = getattr(self, "runner", None)
            if runner is not None:
                runner.discard_all()
            while self._nodes:
                self._nodes.pop().cleanup()
        finally:
            if self._switched:
                self._switched = False
                release(self.model)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
