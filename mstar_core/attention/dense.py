"""``DenseAttentionManager``: attention as one dense varlen pass over a contiguous
[frozen prefix | fresh tokens] sequence, through a prefixed ragged wrapper.

For a workload that recomputes every one of its K/V every step and reuses only a small frozen
prefix (diffusion denoise: the prefix is the text conditioning), the paged path's per-step K/V
write and paged plan are pure overhead. This manager gathers each stream's prefix from the
pages once per (stream, layer), keeps it, concatenates it with the freshly projected K/V of
every step, and runs one kernel.

The gathered prefix is keyed on the stream's ``generation`` (and its prefix length and pages),
so a fork, a reset or a page-table move invalidates it. Hazard: the key is only as good as the
generation; a resource driving the KV manager must send this manager the same lifecycle hooks
(``reset_request``/``remove_request``), which drop the request's gathered prefixes outright.

With the KV manager's prefix cache on (``KVManager(..., prefix_cache=True)``), streams whose
prefix begins with the same cached pages (started by ``admit_prefix``: e.g. many requests with
one prompt) share those pages' gathered K/V: one entry per layer under the shared key ``(node,
tokens, pages)``, the node id the last of those pages is keyed under, their tokens and the pages
themselves; a stream's own entry holds only the rest of its prefix (nothing where the cached
pages cover it). A stream shares only the leading keyed pages that the prefix cache's lookup of
its tokens finds to be these very pages (a page computed again while another page published its
key stays the stream's own, although its chain goes on under that page's node). The shared key
is that of the stream's whole run of such pages: a stream that published full pages of its own
after the ones it found cached has a key of its own, and shares nothing with the streams that
have only the cached ones. A shared entry does not follow one stream's generation: a fork bumps
its source's, which rebuilds the source's own entry and re-checks its pages, not the shared one,
whose pages are published and never written. Dropping a request drops a shared entry only with
its last user.

Step declaration: fresh tokens are ordinary ``commit=False`` spans of the ``KVStep``, exactly
as for the paged backend, so query lengths arrive as the KV plan's ``to_compute`` and the
prefix as ``length - to_compute``. The same declaration runs under either backend. Spans with
``commit=True`` (the step that commits the prefix) are written to the pages by ``run`` itself,
so later steps — under this backend or the paged one — find them there; ``commit=False``
tokens are never written (nothing would read them back), hence ``requires_kv_write`` False.

Eager-only: the gather and the concatenation are shape-dependent and allocate; a node running
this walk under a graph should name the paged backend for it.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mstar_core import ops
from mstar_core.attention import calls
from mstar_core.attention.base import AttentionManager, blame, check_q, plan_kwargs
from mstar_core.attention.plans import WrapperSize, ragged_plan
from mstar_core.attention.prefix_cache import GatheredPrefixCache, PrefixCacheStats, SharedKey, StreamId
from mstar_core.attention.protocols import PrefixedPrefillWrapper
from mstar_core.errors import InputError, InputTypeError, StateError, UnknownName
from mstar_core.kv.config import KVConfig
from mstar_core.kv.fp8 import dequantize
from mstar_core.kv.paged import KVManager
from mstar_core.kv.plan import KVPlan, LabelLayout, SpanLayout
from mstar_core.kv.prefix import PrefixCache
from mstar_core.resource import BuildInfo
from mstar_core.step import Step, StepContext

log = logging.getLogger(__name__)

DENSE_CAPABILITY = "prefixed_ragged"


@dataclass(frozen=True)
class DenseSegment:
    """(request, label) of a dense plan: ``prefix_len`` frozen tokens read from ``pages`` (the
    pages that hold them, in order) and ``q_len`` fresh tokens computed this step. ``shared``:
    the leading pages it shares with other streams through the KV manager's prefix cache, as
    ``(node, tokens, pages)`` (see the module docstring), or None."""

    request_id: str
    label: str
    pages: tuple[int, ...]
    prefix_len: int
    q_len: int
    generation: int
    shared: SharedKey | None = None

    @property
    def k_len(self) -> int:
        return self.prefix_len + self.q_len


@dataclass(frozen=True)
class DensePlan:
    """Dense plan layout, made once per step and read by each layer's ``run``.

    Segment i's queries are ``q[cu_q[i]:cu_q[i+1]]``; its keys ``[prefix | fresh]`` are
    ``cu_k[i]:cu_k[i+1]`` of the concatenation ``run`` builds. ``wrapper`` is the planned
    wrapper; it is re-planned by the next step (eager-only), so an old plan must not be run.
    A step with several labels gets one plan per label (``run`` is per label); the plan the
    manager returns for such a step lists every segment and has ``wrapper`` None.
    """

    segments: tuple[DenseSegment, ...]
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    max_q: int
    max_k: int
    causal: bool
    wrapper: PrefixedPrefillWrapper | None = None
    # What each label's run reads (the step's own, whatever was planned since).
    label_runs: tuple[_LabelRun, ...] = field(default=(), compare=False, repr=False)
    # The KV plan of the same step: this plan is usable while that one is live (its step neither
    # committed nor rolled back).
    kv_plan: Any = field(default=None, compare=False, repr=False)

    @property
    def num_q(self) -> int:
        return self.cu_q[-1]

    @property
    def num_k(self) -> int:
        return self.cu_k[-1]


@dataclass(frozen=True)
class _LabelRun:
    label: str
    plan: DensePlan
    q_starts: tuple[int, ...]  # packed offset of each segment's fresh tokens in q/k/v (= cu_q[:-1])
    write: str  # "none" | "all" | "some": which fresh tokens run() writes to the pages
    write_rows: torch.Tensor | None  # for "some": packed rows of commit=True spans, on device
    serial: int = 0  # the plan's number: a wrapper re-planned since is refused at run
    # ``(window_left, wrapper, key)`` per distinct window of the step (one, or one per distinct
    # per-layer window); key = (label, slot, i), i numbering the windows. ``plan.wrapper`` is the first.
    plans: tuple[tuple[int, Any, tuple[str, int, int]], ...] = ()

    @property
    def per_window(self) -> dict[int, tuple[Any, tuple[str, int, int]]]:
        return {w: (wrapper, key) for w, wrapper, key in self.plans}


def resolve_class(spec: Any) -> type:
    """A class, or ``"module:attr"`` imported lazily."""
    if isinstance(spec, str):
        mod, _, attr = spec.partition(":")
        if not attr:
            raise InputError(f"wrapper class {spec!r}: expected 'module:attr'")
        return getattr(importlib.import_module(mod), attr)
    return spec


class DenseAttentionManager(AttentionManager):
    """Attention as one dense varlen pass over [frozen prefix | fresh tokens]. See the module
    docstring.

    ``wrapper_class`` implements :class:`PrefixedPrefillWrapper` (FA3's, AITER's, FlashInfer's
    ragged prefill, or the reference); ``flashinfer_backend`` is passed to it as ``backend``.
    ``max_cached_tokens`` bounds the gathered-prefix cache (prefix tokens summed over entries,
    one entry per (stream, layer)); the least recently used entries go first. None: unbounded,
    which holds ``num_layers x prefix tokens x 2 x H_kv x D`` elements per stream.
    """

    def __init__(
        self,
        kv_cache: KVManager,
        device: torch.device | str,
        dtype: torch.dtype,
        kv_config: KVConfig,
        wrapper_class: type | str,
        flashinfer_backend: str = "auto",
        max_cached_tokens: int | None = None,
        backend_name: str | None = None,
        api_version: str | None = None,
    ) -> None:
        # The model's features are the KV manager's: an FP8 cache is read back here (the gathered
        # prefix dequantised once per stream and layer), so the wrappers see the model dtype.
        self.features = kv_cache.features
        # Which of a step's plans each layer reads (per-layer windows; None: the step's one plan).
        self._layer_plan = self.features.layer_plans()
        self.kv = kv_cache
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_config = kv_config
        self.wrapper_class = resolve_class(wrapper_class)
        self.backend_name = backend_name
        # The contract version the wrapper speaks (mstar_core.attention.calls): its spec's where the
        # registry picked it; else 2.0 where the class builds from a WrapperSize, else 1.1.
        self.api_version = api_version or ("2.0" if hasattr(self.wrapper_class, "from_size") else "1.1")
        self.flashinfer_backend = flashinfer_backend
        self.max_cached_tokens = max_cached_tokens
        self.prefixes = GatheredPrefixCache(max_cached_tokens)
        # Per stream: (generation, pages checked, those pages) and the shared key found for them.
        self._sharing: dict[StreamId, tuple[tuple[int, int, tuple[int, ...]], SharedKey | None]] = {}
        # The KV manager's page pool the shared keys were found in: a new one (its cleanup)
        # numbers its nodes from the start again.
        self._pool = kv_cache.pool
        self._requests: dict[str, dict[str, Any]] = {}
        # One wrapper per (label, slot); consecutive plans alternate slots, so a step planned
        # ahead (prepare(N+1) before launch(N)) never re-plans the wrapper the running one reads.
        self.slots = 2
        self._wrappers: dict[tuple[str, int, int], Any] = {}
        self._planned: dict[tuple[str, int, int], int] = {}  # wrapper key -> serial of its plan
        self._serial = 0
        self._current: DensePlan | None = None
        self.op_handle = ops.register(self)  # what a compiled graph names this manager by

    @classmethod
    def build(cls, spec: Mapping[str, Any], info: BuildInfo) -> DenseAttentionManager:
        """Build over ``info.built[spec.get("kv", "kv")]``. ``spec["wrapper_class"]`` (a class or
        ``"module:attr"``) wins; otherwise the registry picks the ``prefixed_ragged`` backend named
        by ``spec["backend"]`` (a name or "auto")."""
        kv = info.dependency(spec.get("kv", "kv"), cls.__name__)
        if not isinstance(kv, KVManager):
            raise InputTypeError(f"DenseAttentionManager needs a paged KVManager, got {type(kv).__name__}")
        wrapper_class = spec.get("wrapper_class")
        backend_name = api_version = None
        if wrapper_class is None:
            from mstar_core.registry import select_backend  # the registry imports plugins: keep it lazy

            sel = select_backend(
                capabilities=(DENSE_CAPABILITY,), requested=spec.get("backend"), device=info.device,
                dtype=info.dtype, head_dim=info.head_dim, config=spec.get("config"), features=kv.features,
            )
            wrapper_class, backend_name = sel.classes[DENSE_CAPABILITY], sel.name
            api_version = sel.api_version(DENSE_CAPABILITY)
        return cls(kv, info.device, info.dtype, kv.config, wrapper_class,
                   flashinfer_backend=spec.get("flashinfer_backend", "auto"),
                   max_cached_tokens=spec.get("max_cached_tokens"), backend_name=backend_name,
                   api_version=api_version)

    # -- resource identity -------------------------------------------------------------------
    @property
    def requires_kv_write(self) -> bool:
        return False

    def can_capture(self) -> bool:
        return False  # gather + concatenation allocate and depend on shapes

    @property
    def force_double_buffer(self) -> bool:
        # Every plan builds fresh index tensors (no reused host staging buffer) and nothing is
        # replayed, so a plan for step N+1 cannot overwrite what step N still reads.
        return False

    def depends_on(self) -> tuple[str, ...]:
        return (self.kv.name,)

    def fingerprint(self) -> bytes:
        # Deeper layers' K/V (committed by run) depend on earlier layers' attention numerics,
        # so pages written through a different kernel or dtype are not interchangeable.
        w = self.wrapper_class
        return f"attn.dense:{w.__module__}:{w.__qualname__}:{self.dtype}:{self.features!r}".encode()

    # -- requests ----------------------------------------------------------------------------
    def ingest_request(self, rid: str, overrides: Mapping[str, Any] | None = None) -> None:
        # Idempotent: a request served by several partitions is ingested once per partition.
        self._requests.setdefault(rid, dict(overrides or {}))

    def reset_request(self, rid: str, free: bool = False) -> None:
        """Drop ``rid``'s gathered prefixes (its pages are being reset); ``free`` also forgets it.
        A prefix it shares with streams of other requests stays theirs."""
        self._forget_sharing(rid)
        self.prefixes.drop_request(rid)
        if free:
            self._requests.pop(rid, None)

    def remove_request(self, rid: str) -> None:
        """Drop ``rid``'s gathered prefixes and forget it; unknown ``rid`` is a no-op. A prefix it
        shares with streams of other requests stays theirs."""
        self._forget_sharing(rid)
        self.prefixes.drop_request(rid)
        self._requests.pop(rid, None)

    def _forget_sharing(self, rid: str) -> None:
        for sid in [k for k in self._sharing if k[0] == rid]:
            del self._sharing[sid]

    @property
    def stats(self) -> PrefixCacheStats:
        """Hits, gathers, invalidations, evictions of the gathered-prefix cache."""
        return self.prefixes.stats

    @property
    def cached_prefix_tokens(self) -> int:
        """Prefix tokens held by the gathered-prefix cache, summed over its entries (a prefix
        shared by several streams counted once)."""
        return self.prefixes.tokens

    def cached_streams(self) -> set[tuple[str, str]]:
        return self.prefixes.streams()

    # -- step --------------------------------------------------------------------------------
    def plan(self, step: Step, ctx: StepContext) -> DensePlan:
        kv_plan = ctx.plan_results.get(self.kv.name)
        if not isinstance(kv_plan, KVPlan):
            raise StateError(
                f"DenseAttentionManager.plan needs the KV plan in ctx.plan_results[{self.kv.name!r}] "
                f"(plan the KV resource first), found {type(kv_plan).__name__}"
            )
        a = step.attn
        if self.features.layer_windows is not None and a.window_left != -1:
            raise InputError(f"{type(self).__name__}.plan: the step sets window_left={a.window_left}, but the features "
                             "give each layer its window (layer_windows); leave the step's window_left at -1")
        commits = {(s.request_id, s.label): s.commit for s in step.kv.spans}
        if self.kv.pool is not self._pool:
            self._pool = self.kv.pool
            self._sharing.clear()
            self.prefixes.clear()
        self._serial += 1
        runs = tuple(self._plan_label(label, lay, commits, a.causal, a.window_left, a.sm_scale)
                     for label, lay in kv_plan.labels)
        plans = [r.plan for r in runs]
        plan = plans[0] if len(plans) == 1 else _merge(plans, a.causal)
        self._current = replace(plan, label_runs=runs, kv_plan=kv_plan)
        return self._current

    def _plan_label(self, label: str, lay: LabelLayout, commits: dict[tuple[str, str], bool], causal: bool,
                    window_left: int, sm_scale: float | None) -> _LabelRun:
        ps = self.kv_config.page_size
        segs, starts = [], []
        for s in lay.spans:
            if s.to_compute == 0:
                continue  # no query: nothing to attend for this stream
            prefix = s.prefix_len
            pages = tuple(s.source[: -(-prefix // ps)])  # the prefix's pages only
            shared = self._shared_key(s, label, pages)
            segs.append(DenseSegment(s.request_id, label, pages, prefix, s.to_compute, s.generation, shared))
            starts.append(s.q_start)
            # Free a stream's stale layers now rather than as each layer misses.
            self.prefixes.validate((s.request_id, label), (s.generation, prefix, pages), shared)
        cu_q = (0, *itertools.accumulate(g.q_len for g in segs))
        cu_k = (0, *itertools.accumulate(g.k_len for g in segs))
        max_q = max((g.q_len for g in segs), default=0)
        max_k = max((g.k_len for g in segs), default=0)
        # Host tensors: the wrapper moves them to the device once per step, not per layer.
        cu_q_t, cu_k_t = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
        try:  # built and checked once per label; each window's plan shares it
            base = ragged_plan(cu_q_t, cu_k_t, max_q, max_k, self.dtype, causal=causal, sm_scale=sm_scale,
                               logits_soft_cap=self.features.soft_cap, sink_logits=self.features.any_sinks,
                               who=f"{type(self).__name__}.plan")
        except Exception as e:
            blame(e, self.backend_name, self, "plan")
            raise
        plans = []
        for i, window in enumerate(self.features.windows(window_left)):  # one plan per distinct window; run picks
            key = (label, self._serial % self.slots, i)
            w = self._wrappers.get(key)
            if w is None:
                c = self.kv_config
                size = WrapperSize(c.qo_heads, c.num_kv_heads, c.head_dim, self.device,
                                   options={"backend": self.flashinfer_backend})
                try:
                    w = calls.build_wrapper(self.wrapper_class, DENSE_CAPABILITY, size, self.api_version)
                except Exception as e:
                    blame(e, self.backend_name, self.wrapper_class, "__init__")
                    raise
                self._wrappers[key] = w
            self._planned.pop(key, None)  # a refused plan leaves the wrapper's old plan unusable either way
            try:
                calls.plan_ragged(w, replace(base, window_left=window), self.api_version)
            except Exception as e:
                blame(e, self.backend_name, w, "plan")
                raise
            self._planned[key] = self._serial
            plans.append((window, w, key))
        w = plans[0][1]
        flags = [commits.get((s.request_id, label), True) for s in lay.spans]
        rows = None
        if all(flags):
            write = "all"
        elif not any(flags):
            write = "none"
        else:
            write = "some"
            keep = torch.cat([torch.full((s.to_compute,), f, dtype=torch.bool)
                              for s, f in zip(lay.spans, flags, strict=True)])
            rows = keep.nonzero().flatten().to(self.device)
        plan = DensePlan(tuple(segs), cu_q, cu_k, max_q, max_k, causal, w)
        log.debug("dense plan %r: %d segments, %d queries, %d keys, write %s", label, len(segs), cu_q[-1], cu_k[-1],
                  write)
        return _LabelRun(label, plan, tuple(starts), write, rows, self._serial, tuple(plans))

    def _shared_key(self, span: SpanLayout, label: str, pages: tuple[int, ...]) -> SharedKey | None:
        """The leading full pages of ``span``'s prefix that other streams may share: those of its
        keyed pages that the prefix cache's lookup of its tokens finds to be these very pages, as
        ``(node, tokens, pages)``; None where there are none (or the prefix cache is off). Looked
        up once per (stream generation, pages), not per step."""
        cache = self.kv.pool
        if not isinstance(cache, PrefixCache):
            return None
        sid = (span.request_id, label)
        st = self.kv.streams.get(sid)
        chain = st.chain if st is not None and st.generation == span.generation else None
        ps = self.kv_config.page_size
        most = 0 if chain is None else min(chain.keyed, span.prefix_len // ps)
        if chain is None or most == 0:
            self._sharing.pop(sid, None)
            return None
        checked = (span.generation, most, pages[:most])
        known = self._sharing.get(sid)
        if known is not None and known[0] == checked:
            return known[1]
        # Rule: share only the pages lookup finds under the node: published (read-only), held, nodes never reused.
        found, node = cache.lookup(chain.root, chain.tokens, most)
        n = next((i for i, p in enumerate(found) if p != pages[i]), len(found))  # found: at most `most` pages
        if 0 < n < len(found):
            _, node = cache.lookup(chain.root, chain.tokens, n)
        shared = (node, n * ps, pages[:n]) if n else None
        self._sharing[sid] = (checked, shared)
        return shared

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
        """One layer's dense attention. ``k``/``v`` are this step's freshly projected K/V
        ``[tokens, H_kv, D]``, packed in the plan's segment order; ``commit=False`` tokens are
        never written to the pages. ``layer_idx`` keys the gathered prefix (and picks the layer's
        window) and is required; ``sinks [Hq]``: the layer's sink logits. Under ``torch.compile``
        this is the op ``mstar::dense_run`` (:mod:`mstar_core.ops`), which finds the bound step's
        plan when it runs."""
        if torch.compiler.is_compiling() and layer_idx is not None and k is not None and v is not None:
            # The op writes and reads the whole cache (what it mutates): layer_idx picks the layer.
            return ops.dense_run(q, k, v, self.kv.storage, self.op_handle, layer_idx, label or "", sinks)
        return self.run_eager(q, label, None, k, v, layer_idx, sinks, kv_cache_layer)

    def run_eager(self, q: torch.Tensor, label: str | None, storage: torch.Tensor | None, k: torch.Tensor | None,
                  v: torch.Tensor | None, layer_idx: int | None, sinks: torch.Tensor | None,
                  kv_cache_layer: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`run` outside a compiled graph, over ``storage``: the cache (None), or the copy of
        it a compiled graph passed; ``kv_cache_layer``, where the caller gave one, must be its layer."""
        who = type(self).__name__
        if layer_idx is None:
            raise InputError(f"{who}.run needs layer_idx: the gathered prefix is cached per (stream, layer)")
        i = 0 if self._layer_plan is None else self._layer_plan[self.kv.check_layer(layer_idx)]
        lr, wrapper = self._label_run(label, i)
        c = self.kv_config
        n = lr.plan.num_q
        check_q(q, n, c.qo_heads, c.head_dim, self.dtype, who)
        for name, t in (("k", k), ("v", v)):
            if t is None:
                raise InputError(
                    f"{who}.run: {name} is None; the dense path takes this step's fresh K/V in the call "
                    "(requires_kv_write is False: pass k=, v= instead of writing them)"
                )
            if tuple(t.shape) != (n, c.num_kv_heads, c.head_dim):
                raise InputError(f"{who}.run: {name} has shape {tuple(t.shape)}, expected "
                                 f"{(n, c.num_kv_heads, c.head_dim)} [tokens, H_kv, D]")
            if t.dtype != self.dtype:
                raise InputTypeError(f"{who}.run: {name} has dtype {t.dtype}, expected {self.dtype} "
                                     "(the cache's dtype)")
        self.features.check_sinks(sinks, c.qo_heads, q.device, f"{who}.run", self.kv.check_layer(layer_idx))
        if kv_cache_layer is not None:
            # layer_idx keys the gathered prefix and picks the FP8 scales: they must be the view's layer's
            self.kv.check_layer_view(kv_cache_layer, self.kv.check_layer(layer_idx), f"{who}.run")
        storage = self.kv.storage if storage is None else storage
        assert k is not None and v is not None
        self._write_committed(lr, k, v, layer_idx, storage)
        keys, values = self._assemble(lr, k, v, storage[self.kv.check_layer(layer_idx)], layer_idx)
        try:
            return wrapper.run(q, keys, values, **plan_kwargs(sinks=sinks))
        except Exception as e:
            blame(e, self.backend_name, wrapper, "run")
            raise

    def _label_run(self, label: str | None, i: int) -> tuple[_LabelRun, Any]:
        runs = self.current.label_runs  # one per label, a handful: a scan, not a dict per layer
        lr: _LabelRun | None
        if label is None:
            if len(runs) != 1:
                raise InputError(f"label=None is ambiguous: this step has labels {[r.label for r in runs]}; name one")
            lr = runs[0]
        else:
            lr = next((r for r in runs if r.label == label), None)
            if lr is None:
                raise UnknownName(f"label {label!r} is not in this step; its labels are {[r.label for r in runs]}")
        _, wrapper, key = lr.plans[i]
        if self._planned.get(key) != lr.serial:
            raise StateError(
                f"{type(self).__name__}.run: the wrapper this step planned for label {lr.label!r} was re-planned "
                f"by a later step; at most {self.slots} steps may be planned ahead of the one that runs"
            )
        return lr, wrapper

    def _write_committed(self, lr: _LabelRun, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                         storage: torch.Tensor) -> None:
        """Write the K/V of ``commit=True`` spans to the pages of ``storage``: a later step reads
        them as its prefix, whichever backend it runs under."""
        if lr.write == "none":
            return
        if lr.write == "all":
            self.kv.write_kv_into(storage, k, v, layer_idx, lr.label)
            return
        lay = self.kv.current.layout(lr.label)
        rows = lr.write_rows
        self.kv.store(layer_idx, lay.write_pages[rows], lay.write_offsets[rows], k[rows], v[rows], storage)

    def _gather(self, pages: tuple[int, ...], first: int, tokens: int, layer: torch.Tensor,
                layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of the ``tokens`` tokens from page ``pages[first]`` on: one indexed read for K and
        V together; an FP8 cache's are dequantised here, once per (entry, layer) -- the gathered-prefix
        cache keeps them."""
        ps = layer.shape[2]
        ids = pages[first: first - (-tokens // ps)]
        blk = layer[torch.tensor(ids, dtype=torch.long, device=layer.device)]  # [n_pages, 2, page_size, H_kv, D]
        kv = blk.transpose(0, 1).reshape(2, len(ids) * ps, *layer.shape[3:])[:, :tokens]
        if self.features.quantized:
            k_scale, v_scale = self.kv.scales(layer_idx)
            assert k_scale is not None and v_scale is not None  # an FP8 cache has its scales
            return dequantize(kv[0], k_scale, self.dtype), dequantize(kv[1], v_scale, self.dtype)
        return kv[0].contiguous(), kv[1].contiguous()

    def _assemble(self, lr: _LabelRun, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor,
                  layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[prefix_0 | fresh_0 | prefix_1 | fresh_1 ...]`` in one concatenation each; a prefix
        with shared pages is their shared K/V, then the stream's own rest."""
        segs = lr.plan.segments
        if all(s.prefix_len == 0 for s in segs):
            return k, v  # no prefix anywhere: the fresh K/V already are the keys
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for seg, start in zip(segs, lr.q_starts, strict=True):
            if seg.prefix_len:
                sid, key, shared = (seg.request_id, seg.label), (seg.generation, seg.prefix_len, seg.pages), seg.shared
                own, first = seg.prefix_len, 0
                if shared is not None:
                    pk, pv = self.prefixes.get_shared(sid, layer_idx, key, shared, functools.partial(
                        self._gather, shared[2], 0, shared[1], layer, layer_idx))
                    ks.append(pk)
                    vs.append(pv)
                    own, first = own - shared[1], len(shared[2])
                if own:
                    pk, pv = self.prefixes.get(sid, layer_idx, key, functools.partial(
                        self._gather, seg.pages, first, own, layer, layer_idx), shared)
                    ks.append(pk)
                    vs.append(pv)
            ks.append(k[start:start + seg.q_len])
            vs.append(v[start:start + seg.q_len])
        return torch.cat(ks), torch.cat(vs)

    def cleanup(self) -> None:
        self.prefixes.clear()
        self._sharing.clear()
        self._wrappers.clear()
        self._planned.clear()
        self._current = None


def _merge(plans: list[DensePlan], causal: bool) -> DensePlan:
    """Every label's segments in one plan, for a multi-label step (each label runs its own)."""
    segs = tuple(s for p in plans for s in p.segments)
    return DensePlan(
        segs,
        (0, *itertools.accumulate(s.q_len for s in segs)),
        (0, *itertools.accumulate(s.k_len for s in segs)),
        max((p.max_q for p in plans), default=0),
        max((p.max_k for p in plans), default=0),
        causal,
        None,
    )
