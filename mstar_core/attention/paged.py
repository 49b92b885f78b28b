"""``PagedAttentionManager``: attention over the paged KV, planned once per step, run per layer.

Per label the step is one of three kinds, each its own wrapper: every row one token (decode),
no one-token row (prefill), or both (mixed). Wrappers are built once per (label, kind, slot)
and reused; ``slots`` alternate between consecutive plans so the plan for step N+1 never
overwrites the state a wrapper still holds for step N.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mstar_core import ops
from mstar_core.attention import calls
from mstar_core.attention.base import AttentionManager, blame, check_q
from mstar_core.attention.grouped import GroupedPagedAttentionManager
from mstar_core.attention.groups import select_groups
from mstar_core.attention.plans import PagedPlan, WrapperSize, paged_plan
from mstar_core.capabilities import MIXED, PAGED, PAGED_DECODE, PAGED_PREFILL, paged_step_capability
from mstar_core.errors import InputError, StateError, UnknownName
from mstar_core.features import AttentionFeatures
from mstar_core.kv.config import KVConfig
from mstar_core.kv.paged import KVManager
from mstar_core.kv.plan import LabelLayout
from mstar_core.resource import BuildInfo
from mstar_core.step import Step, StepContext

log = logging.getLogger(__name__)


# (label, kind, slot, bucket, i): i numbers the step's distinct (window, sink logits) (one plan
# each), so a wrapper is reused whatever window a step asks for (with per-layer windows or sink
# logits, i names the same one every step).
WrapperKey = tuple[str, str, int, "int | None", int]


def capture_kinds(features: AttentionFeatures, multi_token_wrapper: str | None = PAGED_PREFILL) -> tuple[str, ...]:
    """The wrapper kinds a captured decode step runs: multi-token decode rows are captured on
    the wrapper that runs them (``multi_token_wrapper``: the selection's; the prefill one unless
    the decode backend declares them), which must then be capturable too."""
    if features.decode_query_tokens == 1 or multi_token_wrapper == PAGED_DECODE:
        return (PAGED_DECODE,)
    return (PAGED_DECODE, PAGED_PREFILL)


def decode_capturable(capturable: Iterable[str], features: AttentionFeatures,
                      multi_token_wrapper: str | None = PAGED_PREFILL) -> bool:
    """Whether a selection whose ``capturable`` kinds are these can have its decode steps
    captured: the ``graph_capturable`` a manager is built with."""
    have = set(capturable)
    return all(k in have for k in capture_kinds(features, multi_token_wrapper))


@dataclass(frozen=True)
class PagedAttnEntry:
    label: str
    kind: str  # "paged_decode" | "paged_prefill" | "mixed"
    num_tokens: int
    # Wrappers hold their plan: ``serial`` is this plan's number, and a wrapper re-planned by a
    # later step (more steps planned ahead than there are slots) is refused at run, not misused.
    serial: int
    # ``(window_left, wrapper, key)`` per distinct (window, sink logits) of the step's layers (at
    # least one; per-layer windows or sink logits give several), which ``run(layer_idx=)`` picks.
    plans: tuple[tuple[int, Any, WrapperKey], ...]

    @property
    def wrapper(self) -> Any:
        """The first plan's wrapper."""
        return self.plans[0][1]

    @property
    def per_window(self) -> dict[int, tuple[Any, WrapperKey]]:
        """``window_left -> (wrapper, key)`` of this step's plans (per window, the last plan)."""
        return {w: (wrapper, key) for w, wrapper, key in self.plans}


@dataclass(frozen=True)
class PagedAttnPlan:
    """One step's planned wrappers, per label."""

    entries: tuple[PagedAttnEntry, ...]
    # The KV plan of the same step: this plan is usable while that one is live (its step neither
    # committed nor rolled back).
    kv_plan: Any = field(default=None, compare=False, repr=False)

    def entry(self, label: str | None) -> PagedAttnEntry:
        if label is None:
            if len(self.entries) != 1:
                raise InputError(f"label=None is ambiguous: this step has labels {[e.label for e in self.entries]}")
            return self.entries[0]
        for e in self.entries:
            if e.label == label:
                return e
        raise UnknownName(f"label {label!r} is not in this step; its labels are {[e.label for e in self.entries]}")



def full_past_capacity(features: AttentionFeatures, kv_config: KVConfig) -> AttentionFeatures:
    """``features`` with every layer window that reaches back as far as the cache can hold made
    full attention (-1): no sequence is longer than the cache, so such a window masks nothing
    (a Mistral-style 4096-token window over a cache sized for short prompts)."""
    capacity = kv_config.max_pages * kv_config.page_size
    windows = features.layer_windows
    if windows is None or all(w < capacity for w in windows):
        return features
    wide = sorted({w for w in windows if w >= capacity})
    log.info("layer windows %s reach past the KV cache (%d pages x %d = %d tokens): full attention for those layers",
             wide, kv_config.max_pages, kv_config.page_size, capacity)
    return replace(features, layer_windows=tuple(-1 if w >= capacity else w for w in windows))


def plan_variants(features: AttentionFeatures, step_window: int) -> tuple[tuple[int, bool], ...]:
    """The distinct ``(window_left, sink logits)`` of a step's layers, in first-layer order: one
    plan each (a kernel that builds a variant for sink logits knows at plan which it serves)."""
    n = features.per_layer_count()
    if n is None:
        return ((step_window, features.any_sinks),)
    return tuple(dict.fromkeys((features.window(i, step_window), features.layer_sinks(i)) for i in range(n)))


def layer_variants(features: AttentionFeatures) -> tuple[int, ...] | None:
    """Per layer, which of :func:`plan_variants`' plans it reads; None where every layer reads
    the step's one plan."""
    n = features.per_layer_count()
    if n is None:
        return None
    variants = plan_variants(features, -1)  # the step's window is the same for every layer
    return tuple(variants.index((features.window(i, -1), features.layer_sinks(i))) for i in range(n))


class PagedAttentionManager(AttentionManager):
    """Attention through a backend's paged prefill / decode / mixed wrappers."""

    def __init__(
        self,
        kv_cache: KVManager,
        device: torch.device | str,
        dtype: torch.dtype,
        kv_config: KVConfig,
        wrappers: Mapping[str, type] | None = None,
        flashinfer_backend: str | None = None,
        max_batch_size: int = 256,
        max_total_tokens: int = 16384,
        max_prefill_rows: int = 8,
        slots: int = 2,
        workspace_bytes: int | None = None,
        accelerator_graph: bool = False,
        graph_capturable: bool | None = None,
        features: AttentionFeatures | None = None,
        backend_name: str | None = None,
        multi_token_wrapper: str = PAGED_PREFILL,
        backend_names: Mapping[str, str] | None = None,
        selection: Any = None,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        """``selection``: the registry's ``Selection``, whole: the wrapper classes, the backend
        serving each kind, the contract version each speaks, where multi-token decode rows run and
        whether decode steps can be captured all come from it (the keywords of the same names are
        for wrappers given without one). ``backend_options``: a backend's own settings, handed to
        its wrappers untouched (``WrapperSize.options``; FlashInfer's ``{"backend": "fa2"}``).
        ``flashinfer_backend`` is kept for one MINOR: it sets ``backend_options["backend"]``."""
        features = kv_cache.features if features is None else features
        if selection is not None:
            wrappers = selection.classes
            backend_name, backend_names = selection.name, selection.names
            multi_token_wrapper = selection.multi_token_wrapper or PAGED_PREFILL
            graph_capturable = decode_capturable(selection.capturable, features, multi_token_wrapper)
        if wrappers is None:
            raise InputError("PagedAttentionManager needs a selection or wrappers (capability -> wrapper class)")
        missing = [c for c in PAGED if c not in wrappers]
        if missing:
            raise InputError(f"PagedAttentionManager needs wrappers for {list(PAGED)}; missing {missing}")
        if multi_token_wrapper not in (PAGED_DECODE, PAGED_PREFILL):
            raise InputError(f"PagedAttentionManager: multi_token_wrapper must be {PAGED_DECODE!r} or "
                             f"{PAGED_PREFILL!r} (the selection's), got {multi_token_wrapper!r}")
        # The model's features; the KV manager's by default (it stores what they ask for).
        self.features = features
        if self.features.kv_dtype != kv_cache.features.kv_dtype:
            raise InputError(f"PagedAttentionManager: features ask for kv_dtype {self.features.kv_dtype!r} but the KV "
                             f"cache stores {kv_cache.features.kv_dtype!r}; build both with the same features")
        self.features.check_layers(kv_config.num_layers, "PagedAttentionManager")
        self.features = full_past_capacity(self.features, kv_config)
        self.kv = kv_cache
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_config = kv_config
        self.wrapper_classes = dict(wrappers)
        # The contract version each kind's wrapper speaks (mstar_core.attention.calls): its spec's;
        # without a selection, 2.0 where the class builds from a WrapperSize, else 1.1.
        self.api_versions = {c: selection.api_version(c) if selection is not None
                             else "2.0" if hasattr(cls, "from_size") else "1.1"
                             for c, cls in self.wrapper_classes.items()}
        self.backend_name = backend_name
        # Which backend each kind's wrapper comes from (errors name it); the one name by default.
        self.backend_names = dict(backend_names) if backend_names else dict.fromkeys(PAGED, backend_name)
        # Uniform rows of decode_query_tokens > 1 run on the decode wrapper (its backend declares
        # them there) or on the prefill wrapper.
        self.multi_token_wrapper = multi_token_wrapper
        self._multi_on_decode = multi_token_wrapper == PAGED_DECODE and self.features.decode_query_tokens > 1
        self.backend_options = dict(backend_options or {})
        if flashinfer_backend is not None:
            warnings.warn("PagedAttentionManager(flashinfer_backend=) is FlashInfer's own setting: pass "
                          "backend_options={'backend': ...}; the keyword goes in the next MINOR", DeprecationWarning,
                          stacklevel=2)
            self.backend_options.setdefault("backend", flashinfer_backend)
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens
        self.max_prefill_rows = max_prefill_rows
        self.slots = slots
        # FlashInfer recommends 128 MiB of workspace per wrapper; the reference needs none.
        self.workspace_bytes = workspace_bytes or ((128 << 20) if self.device.type == "cuda" else 1024)
        self.accelerator_graph = accelerator_graph
        # What the backend declared (the registry passes it); None: ask the decode class.
        self.graph_capturable = graph_capturable
        f = self.features
        # Fixed for the manager's life, so a layer's run only indexes: which of a step's plans each
        # layer reads (per-layer windows; None: the step's one plan), the FP8 scales it passes,
        # and the features' plan keywords.
        self._layer_plan = layer_variants(f)
        self._layer_kw: tuple[dict[str, float | None], ...] | None = None
        if f.quantized:
            self._layer_kw = tuple(dict(zip(("k_scale", "v_scale"), kv_cache.scales(i), strict=True))
                                   for i in range(kv_config.num_layers))
        self._soft_cap = f.soft_cap
        self._kv_data_type = kv_cache.kv_dtype if f.quantized else None
        self._graph_max_bs = 0
        self._wrappers: dict[WrapperKey, Any] = {}
        self._plans = 0
        self._planned: dict[WrapperKey, int] = {}  # wrapper key -> serial of its plan
        self._serial = 0
        self._current: PagedAttnPlan | None = None
        self.op_handle = ops.register(self)  # what a compiled graph names this manager by

    @classmethod
    def build(cls, spec: Mapping[str, Any], info: BuildInfo) -> AttentionManager:
        """Pick the backend (``spec["backend"]``, a name or "auto") through the registry, per
        layer group (:func:`build_paged_attention`: this class where one selection serves every
        layer), and build over ``info.built["kv"]``."""
        kv = info.dependency(spec.get("kv", "kv"), cls.__name__)
        assert isinstance(kv, KVManager)
        keys = ("max_batch_size", "max_total_tokens", "max_prefill_rows", "slots", "accelerator_graph")
        extra = {k: spec[k] for k in keys if k in spec}
        return build_paged_attention(kv, info.device, info.dtype, kv.config, spec.get("backend"), spec.get("config"),
                                     kv.features, head_dim=info.head_dim, **extra)

    def describe(self) -> str:
        """The backend of every paged capability: one name, or ``capability: name`` each."""
        names = self.backend_names
        if len(set(names.values())) <= 1:
            return str(self.backend_name)
        return ", ".join(f"{c}: {n}" for c, n in names.items())

    # -- wrappers ------------------------------------------------------------------------------
    def _ws(self, times: int = 1) -> torch.Tensor:
        return torch.empty(times * self.workspace_bytes, dtype=torch.uint8, device=self.device)

    def _wrapper(self, key: WrapperKey, graph_tokens: int | None = None) -> Any:
        kind, bucket = key[1], key[3]
        w = self._wrappers.get(key)
        if w is None:
            cls = self.wrapper_classes[kind]
            try:
                w = self._build_wrapper(cls, kind, bucket, graph_tokens)
            except Exception as e:
                blame(e, self.backend_names.get(kind), cls, "__init__")
                raise
            self._wrappers[key] = w
        return w

    def _build_wrapper(self, cls: type, kind: str, bucket: int | None, graph_tokens: int | None) -> Any:
        c = self.kv_config
        size = WrapperSize(c.qo_heads, c.num_kv_heads, c.head_dim, self.device, c.page_size,
                           workspace_bytes=self.workspace_bytes, options=self.backend_options)
        if bucket is not None:
            # One graph-mode wrapper per (bucket, slot): its static buffers are what the graph
            # captured for that bucket reads; padding rows add one page each. Multi-token decode
            # rows on the prefill wrapper size it for the bucket's tokens.
            t = graph_tokens // bucket if (kind == PAGED_DECODE and self._multi_on_decode and graph_tokens is not None
                                           and graph_tokens > bucket) else 1
            size = replace(size, batch_size=bucket, max_num_pages=c.max_pages + bucket, accelerator_graph=True,
                           max_total_tokens=graph_tokens if kind == PAGED_PREFILL else None, query_tokens=t)
        elif kind == MIXED:
            size = replace(size, batch_size=self.max_batch_size, max_total_tokens=self.max_total_tokens,
                           max_num_pages=c.max_pages, max_prefill_rows=self.max_prefill_rows)
        return calls.build_wrapper(cls, kind, size, self.api_versions[kind])

    # -- step ----------------------------------------------------------------------------------
    def plan(self, step: Step, ctx: StepContext) -> PagedAttnPlan:
        kv_plan = ctx.plan_results[self.kv.name]
        if ctx.bucket is None:
            slot = self._plans % self.slots
            self._plans += 1
        else:
            slot = ctx.slot
        self._serial += 1
        a = step.attn
        if self.features.layer_windows is not None and a.window_left != -1:
            raise InputError(f"{type(self).__name__}.plan: the step sets window_left={a.window_left}, but the features "
                             "give each layer its window (layer_windows); leave the step's window_left at -1")
        variants = plan_variants(self.features, a.window_left)
        graph_tokens = ctx.graph_tokens
        entries = []
        for label, lay in kv_plan.labels:
            kind = PAGED_DECODE if lay.decode else self._kind(lay.q_lens, a.causal,
                                                              None if ctx.bucket is None else ctx.query_tokens)
            if ctx.bucket is not None:
                self._check_graph_step(kind, ctx, lay)
            plans = []
            p = self._paged_plan(kind, lay, a.causal, a.sm_scale)  # built and checked once per label
            for i, (window, sinks) in enumerate(variants):  # one plan per variant; run(layer_idx) picks
                key = (label, kind, slot, ctx.bucket, i)
                w = self._wrapper(key, graph_tokens)
                self._planned.pop(key, None)  # a refused plan leaves the wrapper's old plan unusable either way
                self._plan_wrapper(w, kind, p.variant(window, sinks))
                self._planned[key] = self._serial
                plans.append((window, w, key))
            if log.isEnabledFor(logging.DEBUG):  # the arguments cost more than the call when it is off
                log.debug("label %r: %s over %d rows, %d tokens (slot %d, bucket %s, (window, sinks) %s)", label,
                          kind, len(lay.q_lens), lay.num_tokens, slot, ctx.bucket, variants)
            entries.append(PagedAttnEntry(label, kind, graph_tokens or lay.num_tokens, self._serial, tuple(plans)))
        self._current = PagedAttnPlan(tuple(entries), kv_plan)
        return self._current

    def _kind(self, q_lens: tuple[int, ...], causal: bool, query_tokens: int | None = None) -> str:
        """The wrapper a label's rows need (one-token decode rows are known from the layout):
        uniform causal rows of ``decode_query_tokens`` -- in a graph step, of its runner's
        ``query_tokens``, at most that many -- go to the decode wrapper where it runs them."""
        t = self.features.decode_query_tokens if query_tokens is None else query_tokens
        if self._multi_on_decode and t > 1 and causal and q_lens and all(n == t for n in q_lens):
            return PAGED_DECODE
        kind = paged_step_capability(q_lens)
        if kind == "mixed" and sum(1 for n in q_lens if n > 1) > self.max_prefill_rows:
            kind = "paged_prefill"  # more prompt rows than the mixed plan holds: one packed plan
        return kind

    def _check_graph_step(self, kind: str, ctx: StepContext, lay: LabelLayout) -> None:
        """Graph steps are decode steps: one token per row, or (multi-token decode) every row
        ``ctx.query_tokens`` tokens, at most the features' ``decode_query_tokens``; these run on the
        prefill wrapper, captured like decode."""
        if not self.accelerator_graph:
            raise StateError("a graph step needs PagedAttentionManager(accelerator_graph=True)")
        t = ctx.query_tokens
        if t > 1:
            if t > self.features.decode_query_tokens:
                raise InputError(f"a graph step of {t} query tokens per row; the features allow "
                                 f"decode_query_tokens={self.features.decode_query_tokens}")
            q_lens = lay.q_lens
            if any(n != t for n in q_lens):
                raise InputError(f"a multi-token decode graph step has {t} query tokens in every row; this one has "
                                 f"rows of {sorted(set(q_lens))}")
        elif kind != "paged_decode":
            raise InputError(f"only decode steps are captured; this step is {kind}")
        if ctx.bucket is not None and ctx.bucket > self._graph_max_bs:
            raise InputError(f"bucket {ctx.bucket} exceeds build_accelerator_graph_buffers' "
                             f"max_bs {self._graph_max_bs}")

    def build_accelerator_graph_buffers(self, slots: int, max_bs: int, max_seq_len: int) -> None:
        """Grow-only: graph-mode wrappers are built per (bucket, slot) at first plan."""
        self.slots = max(self.slots, slots)
        self._graph_max_bs = max(self._graph_max_bs, max_bs)

    def can_capture(self) -> bool:
        """Graph mode on, and the decode wrapper capturable on this device (on a CPU the graph
        runner re-runs its closures, which any wrapper supports)."""
        declared = self.graph_capturable
        if declared is None:
            declared = all(getattr(self.wrapper_classes[k], "graph_capturable", True)
                           for k in capture_kinds(self.features, self.multi_token_wrapper))
        return self.accelerator_graph and (self.device.type == "cpu" or declared)

    def depends_on(self) -> tuple[str, ...]:
        return (self.kv.name,)

    @property
    def supports_preplan(self) -> bool:
        # per-slot wrappers: planning step N+1 never touches what step N's replay reads
        return self.accelerator_graph

    def _paged_plan(self, kind: str, lay: LabelLayout, causal: bool, sm_scale: float | None) -> PagedPlan:
        """The label's plan: the KV layout's arrays, checked once. The mixed split is host
        arithmetic over the pages, so a mixed plan takes the host page indices (no device sync);
        decode and prefill take those gathered on the device."""
        t = 1
        if kind == PAGED_DECODE and self._multi_on_decode and lay.num_tokens != len(lay.q_lens):
            t = lay.num_tokens // len(lay.q_lens)  # uniform rows (_kind)
        indices = lay.kv_indices_host if kind == MIXED else lay.kv_indices
        try:
            return paged_plan(kind, None if kind == PAGED_DECODE else lay.qo_indptr, lay.kv_indptr, indices,
                              lay.kv_last_page_len, self.kv_config.page_size, self.dtype, causal=causal or kind ==
                              PAGED_DECODE, kv_lens=lay.kv_lens, sm_scale=sm_scale, logits_soft_cap=self._soft_cap,
                              kv_data_type=self._kv_data_type, query_tokens=t, who=f"{type(self).__name__}.plan")
        except Exception as e:
            blame(e, self.backend_names.get(kind), self, "plan")
            raise

    def _plan_wrapper(self, w: Any, kind: str, plan: PagedPlan) -> None:
        try:
            calls.plan_paged(w, plan, self.api_versions[kind])
        except Exception as e:
            blame(e, self.backend_names.get(kind), w, "plan")
            raise

    def run(
        self,
        q: torch.Tensor,
        label: str | None = None,
        kv_cache_layer: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        layer_idx: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer: ``layer_idx`` picks the layer's window (per-layer windows) and FP8 scales;
        ``sinks [Hq]`` are this layer's sink logits (features ``sink_logits``). Under
        ``torch.compile`` this is the op ``mstar::paged_run`` (:mod:`mstar_core.ops`), which finds
        the bound step's plan when it runs."""
        if torch.compiler.is_compiling():
            if layer_idx is None:
                raise InputError(f"{type(self).__name__}.run under torch.compile needs layer_idx")
            layer = self.kv.storage[layer_idx] if kv_cache_layer is None else kv_cache_layer
            return ops.paged_run(q, layer, self.op_handle, layer_idx, label or "", sinks)
        return self.run_eager(q, label, kv_cache_layer, layer_idx, sinks)

    def run_eager(self, q: torch.Tensor, label: str | None, kv_cache_layer: torch.Tensor | None,
                  layer_idx: int | None, sinks: torch.Tensor | None, check_view: bool = True) -> torch.Tensor:
        """:meth:`run` outside a compiled graph. ``check_view`` False: ``kv_cache_layer`` is what a
        compiled graph passed for ``layer_idx`` (the layer, or the compiler's copy of it)."""
        who = type(self).__name__
        e = self.current.entry(label)
        i = 0
        li: int | None = None  # layer_idx, checked once where something reads it
        if self._layer_plan is not None:
            if layer_idx is None:
                raise InputError(f"{who}.run: the features give each layer its window or sink logits: run needs "
                                 "layer_idx")
            li = self.kv.check_layer(layer_idx)
            i = self._layer_plan[li]
        _, wrapper, key = e.plans[i]
        if self._planned.get(key) != e.serial:
            raise StateError(
                f"{who}.run: the {e.kind} wrapper this step planned (label {e.label!r}, slot "
                f"{key[2]}) was re-planned by a later step; at most {self.slots} steps may be planned ahead "
                "of the one that runs"
            )
        c = self.kv_config
        check_q(q, e.num_tokens, c.qo_heads, c.head_dim, self.dtype, who)
        if kv_cache_layer is None:
            if layer_idx is None:
                raise InputError("run needs kv_cache_layer or layer_idx")
            li = self.kv.check_layer(layer_idx) if li is None else li
            kv_cache_layer = self.kv.storage[li]  # layer_view, checked already
        elif layer_idx is not None:
            # layer_idx picks the window and FP8 scales: they must be the view's layer's
            li = self.kv.check_layer(layer_idx) if li is None else li
            if check_view:
                self.kv.check_layer_view(kv_cache_layer, li, f"{who}.run")
        if q.device != kv_cache_layer.device:
            raise InputError(f"{who}.run: q is on {q.device}, the KV cache on {kv_cache_layer.device}")
        kw: dict[str, Any] = {}
        if self._layer_kw is not None:
            if layer_idx is None:
                raise InputError(f"{who}.run: an FP8 KV cache has scales per layer: run needs layer_idx")
            kw = self._layer_kw[self.kv.check_layer(layer_idx) if li is None else li]
        self.features.check_sinks(sinks, c.qo_heads, q.device, f"{who}.run", li)
        if sinks is not None:
            kw = {**kw, "sinks": sinks}
        try:
            return wrapper.run(q, kv_cache_layer, **kw)
        except Exception as err:
            blame(err, self.backend_names.get(e.kind), wrapper, "run")
            raise

    def fingerprint(self) -> bytes:
        # Layer L's stored K/V depend on the attention outputs of layers < L, so pages written
        # under another kernel or dtype are not interchangeable (the dense manager says the same).
        names = ",".join(f"{c.__module__}:{c.__qualname__}" for _, c in sorted(self.wrapper_classes.items()))
        # Multi-token decode rows on the decode wrapper are another kernel's than on the prefill one.
        where = f":multi_token_on:{PAGED_DECODE}" if self._multi_on_decode else ""
        return f"attn.paged:{names}:{self.dtype}:{self.features!r}{where}".encode()

    @property
    def force_double_buffer(self) -> bool:
        # Wrappers stage host arrays and copy them asynchronously: a replay must never read
        # a buffer the next plan is overwriting.
        return True

    def cleanup(self) -> None:
        self._wrappers.clear()
        self._planned.clear()
        self._current = None


PagedManager = PagedAttentionManager | GroupedPagedAttentionManager


def summary(attn: PagedManager) -> str:
    """The backend of every paged capability, as logs name it: one name, or ``capability:
    name`` each, or (layer groups) that per group."""
    return attn.describe()


def build_paged_attention(kv: KVManager, device: torch.device | str, dtype: torch.dtype, kv_config: KVConfig,
                          backend: str | Mapping[str, str] | None = None, config: Any = None,
                          features: AttentionFeatures | None = None, registry: Any = None,
                          head_dim: int | None = None, **options: Any) -> PagedManager:
    """The paged attention manager for ``features`` (None: the KV manager's): the backend
    ``backend`` names (or config's, or auto) selected per layer group; one
    :class:`PagedAttentionManager` where one selection serves every layer, else one per group
    under a :class:`GroupedPagedAttentionManager`. ``options``: the managers' keywords
    (``accelerator_graph``, ``max_batch_size``, ...); ``head_dim`` None: the KV layout's."""
    features = kv.features if features is None else features
    features.check_layers(kv_config.num_layers, "PagedAttentionManager")
    select = dict(requested=backend, device=device, dtype=dtype, head_dim=head_dim or kv_config.head_dim, config=config,
                  registry=registry)
    # grouped as the manager plans (a window past the cache is full); the whole model selected as given
    picked = select_groups(full_past_capacity(features, kv_config), kv_config.num_layers, PAGED, features, **select)
    if not picked.split:
        return PagedAttentionManager(kv, device, dtype, kv_config, features=features, selection=picked.whole,
                                     **options)
    managers = [(g, PagedAttentionManager(kv, device, dtype, kv_config, features=g.features, selection=sel,
                                          **options)) for g, sel in picked.groups]
    return GroupedPagedAttentionManager(kv, managers, full_past_capacity(features, kv_config))
