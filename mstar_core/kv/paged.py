"""The paged ``KVManager``: one ``[num_layers, max_pages, 2, page_size, H_kv, D]`` tensor and
a free-page pool, streams per ``(request_id, label)``.

``admit`` reserves the pages a step's spans need (all or nothing), ``plan`` lays the spans out
(pages, ``length``, ``to_compute``, packing order, FlashInfer-style index arrays, write
locations), ``commit`` advances the committed length of ``commit=True`` spans and releases the
pages held only for ``commit=False`` tokens.

With ``prefix_cache=True`` the pool is a :class:`~mstar_core.kv.prefix.PrefixCache`: a stream
started with :meth:`KVManager.admit_prefix` takes the longest run of cached full pages its token
ids begin with (shared, read-only), and its full pages are published as they commit.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mstar_core import ops
from mstar_core.distributed import TensorParallel
from mstar_core.errors import InputError, InputIndexError, InputTypeError, StateError, UnknownName
from mstar_core.features import PLAIN, AttentionFeatures
from mstar_core.kv.config import KVConfig
from mstar_core.kv.fp8 import quantize
from mstar_core.kv.layout import RowBatch, build_layout, row_state
from mstar_core.kv.page_table import PageTable
from mstar_core.kv.plan import TOKEN_ARRAYS, KVPlan, LabelLayout, token_arrays
from mstar_core.kv.pool import PagePool
from mstar_core.kv.prefix import PrefixCache, PrefixChain, PrefixStats
from mstar_core.kv.streams import CacheStream, StreamMap
from mstar_core.resource import BuildInfo, Resource, as_dtype, spec_required
from mstar_core.step import AdmitOutcome, KVSpan, Shortage, Step, StepContext, is_int

log = logging.getLogger(__name__)


class _Admitted:
    """What one step's admit did (kept in ``ctx.admitted``): the pages it took per stream, the
    streams it created, and the stream objects it admitted, in the step's span order (a reset
    replaces the object, so a stale commit or rollback is recognised by identity)."""

    __slots__ = ("_streams", "batch", "created", "keys", "order", "plans", "taken", "version")

    def __init__(self, taken: dict[tuple[str, str], list[int]], created: list[tuple[str, str]],
                 keys: tuple[tuple[str, str], ...], order: list[CacheStream], version: int) -> None:
        self.taken = taken
        self.created = created
        self.keys = keys  # the streams admitted, and their objects (same order)
        self.order = order
        # ``StreamMap.version`` once the admit was done: while it is unchanged, every key still
        # maps to the object admitted for it.
        self.version = version
        # The plans made for this step: live (``write_kv`` may write through them) until the
        # step commits or is rolled back; a commit without one is refused.
        self.plans: list[KVPlan] = []
        self._streams: dict[tuple[str, str], CacheStream] | None = None
        self.batch: RowBatch | None = None  # the kept rows this step's plan read (see RowBatch)

    @property
    def streams(self) -> dict[tuple[str, str], CacheStream]:
        """The admitted stream objects by key (built on first use: the decode path reads
        ``order``)."""
        if self._streams is None:
            self._streams = dict(zip(self.keys, self.order, strict=True))
        return self._streams


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // page_size)


class KVManager(Resource):
    """Paged KV storage with per-step reservation. See the module docstring."""

    name = "kv"

    def __init__(
        self,
        config: KVConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        name: str = "kv",
        features: AttentionFeatures = PLAIN,
        tp: TensorParallel | None = None,
        prefix_cache: bool = False,
    ) -> None:
        if not isinstance(prefix_cache, bool):
            raise InputTypeError(f"KVManager: prefix_cache must be a bool, got {prefix_cache!r}")
        if not isinstance(features, AttentionFeatures):
            raise InputTypeError(f"KVManager: features must be an AttentionFeatures, got {type(features).__name__}")
        features.check_layers(config.num_layers, "KVManager")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype  # what write_kv takes (the model's dtype)
        self.features = features
        # What the pages hold: the model dtype, or FP8 with a K and a V scale per layer
        # (quantised on write; the attention managers pass the scales to the kernels).
        self.kv_dtype = features.kv_torch_dtype(dtype)
        # (k_scale, v_scale) per layer, looked up on every write: None where nothing is quantised.
        self._scales = (tuple(features.scales(i) for i in range(config.num_layers))
                        if features.quantized else None)
        self.name = name
        # The tensor-parallel group whose ranks must hold the same pages (None: no check). Its
        # config is this rank's shard (num_kv_heads / world heads).
        self.tp = tp
        self.storage = torch.zeros(config.shape, dtype=self.kv_dtype, device=self.device)
        self.op_handle = ops.register(self)  # what a compiled graph names this cache by
        self.prefix_cache = prefix_cache
        self.pool = self._new_pool()
        # Streams whose known tokens reach past their keyed pages: what a commit may publish (by id).
        self._publishing: dict[int, CacheStream] = {}
        # match_prefix's answers by the token list's id, for the admit_prefix that follows (_rematch)
        self._matched: dict[int, tuple[int, Sequence[int], list[int], int, list[int], int]] = {}
        # Every stream's pages on the device, updated by delta: a plan gathers kv_indices there.
        self.table = PageTable(self.device, config.max_pages)
        self.streams = StreamMap()
        self._requests: dict[str, dict[str, Any]] = {}
        self._current: KVPlan | None = None
        # Moves on with every change to any stream but those the kept rows make themselves
        # (RowBatch): the rows are valid while their epoch is this one.
        self._epoch = 0
        self._batch: RowBatch | None = None
        # The last steps' streams looked up (keys, StreamMap.version, objects): see _resolve.
        self._resolved: tuple[tuple[tuple[str, str], ...], int, list[CacheStream | None]] | None = None
        # Plans whose step is admitted and neither committed nor rolled back, by id (the dict
        # holds them, so an id is not reused while it is here): ``current`` serves no other.
        self._live_plans: dict[int, KVPlan] = {}
        # Graph mode (build_accelerator_graph_buffers): per-slot static device buffers for the
        # per-token arrays, and a sink page that padding rows write to.
        self._graph_bufs: torch.Tensor | None = None  # [slots, 3, max_bs] int32
        self._pad_cols: torch.Tensor | None = None
        # views of those buffers a graph step writes and reads, per (slot, tokens, padded tokens,
        # written through numpy)
        self._graph_views: dict[tuple[int, int, int, bool], tuple[Any, ...]] = {}
        self._sink_page: int | None = None
        self._generations = itertools.count(1)
        # Streams reset or removed while a step was in flight on them, by id: their pages go back
        # to the pool when that step commits or is rolled back, not before (released once).
        self._parked: dict[int, CacheStream] = {}

    @classmethod
    def build(cls, spec: Mapping[str, Any], info: BuildInfo) -> KVManager:
        cfg = KVConfig(
            num_layers=info.num_layers,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            page_size=int(spec.get("page_size", 16)),
            max_pages=int(spec_required(spec, "max_pages", cls.__name__)),
            num_qo_heads=info.num_qo_heads,
        )
        return cls(cfg, info.device, as_dtype(spec.get("dtype", info.dtype)), name=spec.get("name", "kv"),
                   features=info.features, prefix_cache=spec.get("prefix_cache", False))

    def _new_pool(self) -> PagePool:
        n = self.config.max_pages
        return PrefixCache(n, self.config.page_size) if self.prefix_cache else PagePool(n)

    def fingerprint(self) -> bytes:
        # What a page holds depends on the geometry, the stored dtype and FP8 scales, and the
        # features (windows and sinks change deeper layers' K/V through the attention outputs).
        c = self.config
        return (f"kv.paged:{c.num_layers}x{c.num_kv_heads}x{c.head_dim}/{c.page_size}:{self.dtype}:{self.kv_dtype}:"
                f"{self._scales}:{self.features!r}").encode()

    @functools.cached_property
    def _fingerprint(self) -> bytes:
        return self.fingerprint()  # what it is made of is fixed at construction

    # -- requests ----------------------------------------------------------------------------
    @property
    def requests(self) -> tuple[str, ...]:
        return tuple(self._requests)

    def ingest_request(self, rid: str, overrides: Mapping[str, Any] | None = None) -> None:
        # Idempotent: a second ingest (another partition of the same request) changes nothing.
        self._requests.setdefault(rid, dict(overrides or {}))

    def stream(self, rid: str, label: str) -> CacheStream:
        try:
            return self.streams[(rid, label)]
        except KeyError:
            raise UnknownName(f"no stream ({rid!r}, {label!r}); known streams: {sorted(self.streams)}") from None

    def _free_streams(self, rid: str) -> None:
        for key in [k for k in self.streams if k[0] == rid]:
            old = self.streams[key]
            self._publishing.pop(id(old), None)  # its tokens no longer say what its pages will hold
            if old.in_flight:
                # A step admitted on it may still write its pages (a replayed graph writes without
                # the host seeing it): they stay out of the pool until that step lands.
                self._parked[id(old)] = old
            else:
                self.pool.give_back(old.pages)
                self._drop(old)
            # A new object, not the old one emptied: a step admitted before the reset holds the
            # old one, and its commit or rollback recognise by identity that it is stale.
            self.streams[key] = CacheStream(*key, generation=next(self._generations))

    def reset_request(self, rid: str, free: bool = False) -> None:
        """Return the request's pages to the pool, set its streams' length to 0 and bump their
        ``generation``. ``free=True`` also forgets the request (it must be ingested again). The
        pages of a stream with a step in flight are parked until that step commits (its span is
        dropped) or is rolled back: its forward may still write them, and nobody else may."""
        self._epoch += 1
        self._free_streams(rid)
        if free:
            self._forget(rid)

    def remove_request(self, rid: str) -> None:
        """Free the request's pages and forget it. An unknown ``rid`` is a no-op (removal is
        idempotent, like ingest)."""
        self._epoch += 1
        if rid not in self._requests:
            log.debug("remove_request(%r): unknown request, nothing to do", rid)
            return
        self._free_streams(rid)
        self._forget(rid)

    def _append(self, stream: CacheStream, pages: list[int]) -> None:
        """Give ``stream`` more pages: on the host list, and as pending writes to its table row."""
        if stream.table_row < 0:
            stream.table_row = self.table.assign()
        self.table.write(stream.table_row, len(stream.pages), pages)
        stream.pages.extend(pages)

    def _drop(self, stream: CacheStream) -> None:
        """``stream`` is gone and no step in flight plans from it: its table row is free."""
        self.table.release(stream.table_row)
        stream.table_row = -1

    def _forget(self, rid: str) -> None:
        for key in [k for k in self.streams if k[0] == rid]:
            del self.streams[key]
        self._requests.pop(rid, None)

    # -- step --------------------------------------------------------------------------------
    def fork(self, src_rid: str, dst_rid: str, label: str) -> AdmitOutcome:
        """Give ``dst_rid`` (ingested, with no stream under ``label`` yet) a copy of
        ``src_rid``'s committed ``label`` stream: fresh pages, the page contents copied on the
        device for every layer. Both streams get a new ``generation``: whatever was derived from
        the source's pages is invalidated. Short of pages, nothing changes and the
        refusal is returned."""
        self._epoch += 1
        src = self.stream(src_rid, label)
        if dst_rid not in self._requests:
            raise UnknownName(f"fork into request {dst_rid!r}, which was never ingested; "
                              f"ingested: {sorted(self._requests)}")
        if (dst_rid, label) in self.streams:
            raise InputError(f"fork: request {dst_rid!r} already has a {label!r} stream")
        # Only the committed tokens' pages: a step in flight on the source may hold more. With the
        # prefix cache the full ones are shared (no step writes a full committed page again).
        n = pages_for(src.length, self.config.page_size)
        cache = self.pool if isinstance(self.pool, PrefixCache) else None
        shared = src.pages[: src.length // self.config.page_size] if cache is not None else []
        k = n - len(shared)
        if k > self.pool.num_free:
            return AdmitOutcome.refuse(Shortage(self.name, "pages", k, self.pool.num_free, dst_rid))
        pages = self.pool.take(k)
        if k:
            self.storage[:, pages] = self.storage[:, src.pages[len(shared): n]]
        if cache is not None and shared:
            cache.share(shared)
        dst = CacheStream(dst_rid, label, [], src.length, next(self._generations))
        self._append(dst, [*shared, *pages])
        if src.chain is not None:
            dst.chain = src.chain.copy(src.length)
            self._track(dst)
        self.streams[(dst_rid, label)] = dst
        src.generation = next(self._generations)
        return AdmitOutcome.ok()

    # -- prefix cache ------------------------------------------------------------------------
    def _cache(self, who: str) -> PrefixCache:
        if not isinstance(self.pool, PrefixCache):
            raise StateError(f"{self.name}: {who} needs the prefix cache, which is off; build "
                             "KVManager(..., prefix_cache=True)")
        return self.pool

    def _root(self, cache: PrefixCache, root: bytes, label: str) -> int:
        if not isinstance(root, bytes):
            raise InputTypeError(f"{self.name}: root must be bytes (Node.prefix_root(model)), got "
                                 f"{type(root).__name__}")
        return cache.root((self._fingerprint, root, label))

    def _check_ids(self, token_ids: Sequence[int], who: str) -> list[int]:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InputTypeError(f"{who}: token_ids must be a sequence of ints, got {type(token_ids).__name__}")
        ids = list(token_ids)
        if not set(map(type, ids)) <= {int} and not all(is_int(t) for t in ids):  # plain ints: checked in C
            bad = next(t for t in ids if not is_int(t))
            raise InputTypeError(f"{who}: token_ids must be ints, got {bad!r} ({type(bad).__name__})")
        return ids

    def match_prefix(self, token_ids: Sequence[int], root: bytes, label: str) -> int:
        """How many tokens :meth:`admit_prefix` would find cached for ``token_ids`` now (full
        pages, at most ``len - 1`` tokens); changes nothing."""
        cache = self._cache("match_prefix")
        ids = self._check_ids(token_ids, f"{self.name}.match_prefix")
        node = self._root(cache, root, label)
        pages, last = cache.lookup(node, ids, (len(ids) - 1) // self.config.page_size)
        if len(self._matched) >= 1024 or (self._matched and next(iter(self._matched.values()))[0] != cache.version):
            self._matched.clear()
        self._matched[id(token_ids)] = (cache.version, token_ids, ids, node, pages, last)
        return len(pages) * self.config.page_size

    def _rematch(self, cache: PrefixCache, token_ids: Sequence[int],
                 node: int) -> tuple[list[int], list[int], int] | None:
        """What :meth:`match_prefix` found for this very token list under ``node``, if no key was
        published or evicted since and the list still holds those tokens (the scheduler matches
        a prompt, then admits it: one walk, not two)."""
        got = self._matched.pop(id(token_ids), None)
        if got is None or got[0] != cache.version or got[1] is not token_ids or got[3] != node:
            return None
        ids = got[2]
        return (ids, got[4], got[5]) if len(token_ids) == len(ids) and list(token_ids) == ids else None

    def admit_prefix(self, rid: str, label: str, token_ids: Sequence[int], root: bytes = b"") -> AdmitOutcome:
        """Start stream ``(rid, label)`` (ingested, with no tokens yet) from the longest run of
        cached full pages ``token_ids`` begins with under ``root`` (:meth:`Node.prefix_root`: the
        resources' fingerprints and the model's identity; this cache adds its own and the
        label). At most ``len(token_ids) - 1`` tokens are found: the last one is always
        computed. The pages are shared and read-only; ``token_ids`` are remembered, so the full
        pages this stream's steps commit are published. Returns the outcome with
        ``cached_tokens``: the stream's first step computes ``token_ids[cached_tokens:]``."""
        cache = self._cache("admit_prefix")
        who = f"{self.name}.admit_prefix({rid!r}, {label!r})"
        node = self._root(cache, root, label)
        again = self._rematch(cache, token_ids, node)
        ids = self._check_ids(token_ids, who) if again is None else again[0]
        if not ids:
            raise InputError(f"{who}: token_ids is empty")
        if rid not in self._requests:
            raise UnknownName(f"{who}: request {rid!r} was never ingested; ingested: {sorted(self._requests)}")
        key = (rid, label)
        st = self.streams.get(key)
        if st is not None and (st.length or st.pages or st.in_flight or st.chain is not None):
            raise StateError(f"{who}: the stream already holds {st.length} tokens (or a step in flight); a stream "
                             "starts from the cache once, before its first step (reset_request to start over)")
        ps = self.config.page_size
        pages, last = cache.lookup(node, ids, (len(ids) - 1) // ps) if again is None else again[1:]
        self._epoch += 1
        if st is None:
            st = self.streams[key] = CacheStream(rid, label, generation=next(self._generations))
        if pages:
            cache.share(pages)
            self._append(st, pages)
            st.length = len(pages) * ps
        st.chain = PrefixChain(node, ids, len(pages), last)
        self._track(st)
        s = cache.stats
        s.lookups += 1
        s.lookup_tokens += len(ids)
        s.hit_tokens += st.length
        log.debug("%s: %d of %d tokens found cached", who, st.length, len(ids))
        return AdmitOutcome(True, cached_tokens=st.length)

    def extend_tokens(self, rid: str, label: str, token_ids: Sequence[int]) -> None:
        """Tokens that follow what ``(rid, label)``'s chain knows (its prompt): e.g. the tokens it
        generated, so a later prompt that repeats them (a chat's next turn) finds their pages.
        Pages already committed are published now, later ones as they commit."""
        who = f"{self.name}.extend_tokens({rid!r}, {label!r})"
        self._cache("extend_tokens")
        ids = self._check_ids(token_ids, who)
        st = self.stream(rid, label)
        if st.chain is None:
            raise StateError(f"{who}: the stream was not started with admit_prefix, so its tokens are unknown")
        st.chain.tokens.extend(ids)
        self._track(st)
        self._publish()

    def _track(self, st: CacheStream) -> None:
        """Watch ``st`` at commits while its known tokens reach past its keyed pages."""
        ch = st.chain
        if ch is not None and len(ch.tokens) // self.config.page_size > ch.keyed:
            self._publishing[id(st)] = st

    def _publish(self) -> None:
        """Publish the full pages the watched streams have committed (cost: the watched streams,
        none in a decode loop whose prompts are published)."""
        cache = self.pool
        assert isinstance(cache, PrefixCache)
        ps = self.config.page_size
        for sid, st in list(self._publishing.items()):
            ch = st.chain
            assert ch is not None
            upto = min(st.length, len(ch.tokens)) // ps
            if upto > ch.keyed:
                adopted = cache.publish(ch, st.pages, upto)
                if adopted:
                    st.pages = list(st.pages)  # a new list: plans made before read the old one
                    for i, page in adopted:
                        st.pages[i] = page
                        self.table.write(st.table_row, i, [page])
                    self._epoch += 1  # the kept rows read the streams' pages again
                    log.debug("%s: stream (%r, %r) takes %d cached pages in place of its copies", self.name,
                              st.request_id, st.label, len(adopted))
            if ch.keyed >= len(ch.tokens) // ps:
                del self._publishing[sid]

    @property
    def prefix_stats(self) -> PrefixStats:
        """The prefix cache's counters (lookups, tokens found, pages published and evicted)."""
        return self._cache("prefix_stats").stats

    def clear_prefix_cache(self) -> int:
        """Evict every cached page no stream holds (e.g. after the model's weights changed; a new
        model identity in the root does the same for new streams). Returns how many."""
        cache = self._cache("clear_prefix_cache")
        n = cache.idle
        cache.clear()
        return n

    def invalidate_stream(self, rid: str, label: str) -> int:
        """Declare that what ``(rid, label)``'s pages hold changed outside a step (a page-table
        move, an external write): gives the stream a new ``generation``, so caches derived from
        its pages are rebuilt. Returns the new generation."""
        self._epoch += 1
        s = self.stream(rid, label)
        s.generation = next(self._generations)
        return s.generation

    def _check_spans(self, step: Step) -> None:
        for s in step.kv.spans:
            if s.request_id not in self._requests:
                raise UnknownName(
                    f"span for request {s.request_id!r}, which was never ingested; "
                    f"ingested: {sorted(self._requests)}"
                )

    def admit(self, step: Step, ctx: StepContext) -> AdmitOutcome:
        """Reserve the pages every span needs, all or nothing. A stream may have one step in
        flight: admitting it again before that step's ``commit`` or ``rollback_admit`` is an
        error (both steps would plan the same positions)."""
        if self.name in ctx.admitted:
            raise StateError(
                f"{self.name}: this StepContext already holds an admitted step; one step per context "
                "(commit or roll it back, and admit the next step into a new StepContext)"
            )
        kvs = step.kv
        keys = kvs.keys()
        b = self._batch
        kept = b is not None and b.epoch == self._epoch and (b.keys is keys or b.keys == keys)
        self._epoch += 1
        if kept and kvs.uniform_tokens is not None:
            assert b is not None
            return self._admit_kept(b, step, ctx)
        ps = self.config.page_size
        streams = self.streams
        got = self._resolve(keys)
        n = kvs.uniform_tokens
        if n is not None:
            # the rows whose stream is new or short of pages for this step: the ones with work to do
            short = [i for i, st in enumerate(got) if st is None or st.length + n > len(st.pages) * ps]
        else:
            short = [i for i, (st, k) in enumerate(zip(got, kvs.token_counts, strict=True))
                     if st is None or st.length + k > len(st.pages) * ps]
        if any(got[i] is None and keys[i][0] not in self._requests for i in short):
            self._check_spans(step)  # raises, naming the first request never ingested
        busy = [k for k, st in zip(keys, got, strict=True) if st is not None and st.in_flight]
        if busy:
            raise StateError(
                f"{self.name}: streams {busy} already have an admitted step that was neither committed "
                "nor rolled back; commit (or discard) it before admitting the next"
            )
        counts = kvs.token_counts
        need: dict[tuple[str, str], int] = {}
        for i in short:
            st, k = got[i], counts[i]
            need[keys[i]] = pages_for(k, ps) if st is None else max(0, pages_for(st.length + k, ps) - len(st.pages))
        total = sum(need.values())
        free = self.pool.num_free
        if total > free:
            # The step waits as a whole (all or nothing); name the requests that do not fit once
            # the ones before them in the step that do fit have taken their pages.
            short_of, taken_before = [], 0
            for (rid, _), k in need.items():
                if taken_before + k > free:
                    short_of.append(Shortage(self.name, "pages", k, free - taken_before, rid))
                else:
                    taken_before += k
            return AdmitOutcome.refuse(Shortage(self.name, "pages", total, free), *short_of)
        taken: dict[tuple[str, str], list[int]] = {}
        created: list[tuple[str, str]] = []
        pages: list[int] = []
        try:
            pages = self.pool.take(total) if total else []  # one take, handed out in span order
            at = 0
            for i in short:
                key, st = keys[i], got[i]
                if st is None:
                    st = got[i] = streams[key] = CacheStream(*key, generation=next(self._generations))
                    created.append(key)
                k = need[key]
                if k:
                    taken[key] = pages[at: at + k]
                    at += k
                    self._append(st, taken[key])
            admitted: list[CacheStream] = got  # type: ignore[assignment]  # every row has its stream now
            for st in admitted:
                st.in_flight = True
        except BaseException:
            # All or nothing, whatever interrupted the admit (KeyboardInterrupt included): undo
            # gives back what the record holds, and the rest of the one take goes back here.
            held = [(k, st) for k, st in zip(keys, got, strict=True) if st is not None]
            # (the busy check passed: none of them was in flight before this admit)
            self._undo(_Admitted(taken, created, tuple(k for k, _ in held), [st for _, st in held], -1))
            recorded = {p for k in taken for p in taken[k]}
            rest = [p for p in pages if p not in recorded]
            if rest:
                self.pool.give_back(rest)
            raise
        ctx.admitted[self.name] = _Admitted(taken, created, keys, admitted, streams.version)
        return AdmitOutcome.ok()

    def _admit_kept(self, b: RowBatch, step: Step, ctx: StepContext) -> AdmitOutcome:
        """``admit`` of a step over the kept rows ``b``, no stream changed since they were last
        read or updated: the pages each row needs from the kept arrays, and page work only for
        the rows that cross into a new page."""
        n = step.kv.uniform_tokens
        assert n is not None
        keys = b.keys
        if b.in_flight:
            raise StateError(
                f"{self.name}: streams {list(keys)} already have an admitted step that was neither committed "
                "nor rolled back; commit (or discard) it before admitting the next"
            )
        ps = self.config.page_size
        rows = np.flatnonzero(b.slack < n).tolist()
        # pages each of them needs: one, unless a row's n tokens span more than one page
        counts = [1] * len(rows) if n <= ps else ((n - b.slack[rows] + ps - 1) // ps).tolist()
        total = sum(counts)
        free = self.pool.num_free
        if total > free:  # as the other path refuses it; nothing changed, the rows stay valid
            short_of, taken_before = [], 0
            for i, k in zip(rows, counts, strict=True):
                if taken_before + k > free:
                    short_of.append(Shortage(self.name, "pages", k, free - taken_before, keys[i][0]))
                else:
                    taken_before += k
            b.epoch = self._epoch
            return AdmitOutcome.refuse(Shortage(self.name, "pages", total, free), *short_of)
        taken: dict[tuple[str, str], list[int]] = {}
        pages: list[int] = []
        streams = b.streams
        try:
            pages = self.pool.take(total) if total else []
            at = 0
            for i, k in zip(rows, counts, strict=True):
                st = streams[i]
                taken[keys[i]] = pages[at: at + k]
                at += k
                self._append(st, taken[keys[i]])
                b.table_row[i] = st.table_row
            for st in streams:
                st.in_flight = True
        except BaseException:
            # as the other path: the kept rows are stale from here (the epoch moved on)
            self._undo(_Admitted(taken, [], keys, streams, -1))
            recorded = {p for k in taken for p in taken[k]}
            rest = [p for p in pages if p not in recorded]
            if rest:
                self.pool.give_back(rest)
            raise
        if rows:
            b.slack[rows] += np.multiply(counts, ps, dtype=np.int32)
        b.in_flight = True
        b.epoch = self._epoch
        rec = _Admitted(taken, [], keys, streams, self.streams.version)
        rec.batch = b
        ctx.admitted[self.name] = rec
        return AdmitOutcome.ok()

    def _kept(self, rec: _Admitted, step: Step) -> RowBatch | None:
        """The kept rows ``rec`` was admitted over or planned from, if they are still valid (no
        stream changed since) and ``step`` is over all of them."""
        b = rec.batch
        if b is None or b is not self._batch or b.epoch != self._epoch:
            return None
        keys = step.kv.keys()
        return b if b.keys is keys or b.keys == keys else None

    def _resolve(self, keys: tuple[tuple[str, str], ...]) -> list[CacheStream | None]:
        """Each key's current stream object (None: none yet). A step over the same streams as the
        previous resolve, with no stream set or removed since, reuses that answer: a decode loop
        looks its rows up once, not once per step."""
        last = self._resolved
        if last is not None and last[1] == self.streams.version and (last[0] is keys or last[0] == keys):
            return list(last[2])
        got = list(map(self.streams.get, keys))
        if all(st is not None for st in got):
            self._resolved = (keys, self.streams.version, got)
        return got

    def _land(self, rec: _Admitted) -> None:
        """``rec``'s step committed or was rolled back: its plans are dead (a later ``write_kv``
        through them would write pages that may be another stream's by now)."""
        for p in rec.plans:
            self._live_plans.pop(id(p), None)
        if self._current is not None and id(self._current) not in self._live_plans:
            self._current = None

    def _undo(self, rec: _Admitted) -> None:
        """Give back what ``rec`` took from streams that are still the ones it admitted."""
        self._land(rec)
        for key, stream in rec.streams.items():
            if self.streams.get(key) is not stream:
                # reset or removed after the admit: its pages were parked until now
                log.debug("%s: stream %s was reset or removed after admit; its parked pages go back", self.name, key)
                self._unpark(stream)
                continue
            stream.in_flight = False
            pages = rec.taken.get(key, [])
            if pages:
                # The step's pages are the tail of the stream's list: admit appended them (an
                # admit interrupted between take and append left them only in the record).
                if stream.pages[-len(pages):] == pages:
                    # in place (O(pages dropped)): the rolled-back step's plan is dead, nothing reads it
                    del stream.pages[-len(pages):]
                elif set(pages) & set(stream.pages):
                    raise StateError(f"{self.name}: stream {key}: pages changed between admit and rollback")
                self.pool.give_back(pages)
            if key in rec.created and not stream.pages and not stream.length:
                del self.streams[key]
                self._drop(stream)

    def _unpark(self, stream: CacheStream) -> None:
        """The step in flight on a reset or removed stream landed: its pages go back now."""
        if self._parked.pop(id(stream), None) is not None:
            stream.in_flight = False
            self.pool.give_back(stream.pages)
            self._drop(stream)

    def _record(self, ctx: StepContext, step: Step, what: str) -> _Admitted:
        """This context's admit record, covering every stream of ``step``; an error naming the
        streams otherwise (never admitted, committed already, or rolled back)."""
        rec: _Admitted | None = ctx.admitted.get(self.name)
        keys = step.kv.keys()
        if rec is not None and (rec.keys is keys or rec.keys == keys):
            return rec
        held = rec.streams if rec is not None else {}
        missing = [k for k in keys if k not in held]
        if rec is None or missing:
            raise StateError(
                f"{self.name}: {what} of streams {missing} that this StepContext has no live admit for "
                "(never admitted, already committed, or rolled back); admit the step first"
            )
        return rec

    def _admitted_streams(self, rec: _Admitted, step: Step) -> tuple[list[CacheStream | None], bool]:
        """The stream objects ``rec`` admitted for ``step``'s spans, in span order, each None
        where it is no longer the current one (reset or removed since, or re-created); and
        whether none is None."""
        keys = step.kv.keys()
        same = rec.keys is keys or rec.keys == keys
        order: list[CacheStream | None] = list(rec.order) if same else [rec.streams[k] for k in keys]
        if rec.version == self.streams.version:
            return order, True  # no stream set or removed since the admit: all current
        now = map(self.streams.get, keys)
        order = [st if cur is st else None for st, cur in zip(order, now, strict=True)]
        return order, None not in order

    def rollback_admit(self, step: Step, ctx: StepContext) -> None:
        """Return exactly the pages this step's admit took, and drop streams it created. A
        stream reset or removed since the admit already gave its pages back: it is skipped.
        Without a live admit record (never admitted, committed, rolled back already): nothing."""
        self._epoch += 1
        rec: _Admitted | None = ctx.admitted.pop(self.name, None)
        if rec is not None:
            self._undo(rec)

    def plan(self, step: Step, ctx: StepContext) -> KVPlan:
        rec = self._record(ctx, step, "plan")
        ps = self.config.page_size
        kvs = step.kv
        b = self._kept(rec, step)
        if b is not None:
            streams = b.streams  # no stream set or removed since they were kept
        else:
            order, current = self._admitted_streams(rec, step)
            if not current:
                s = kvs.spans[[st is None for st in order].index(True)]
                raise StateError(f"{self.name}: plan: stream ({s.request_id!r}, {s.label!r}) was reset or removed "
                                 "after this step's admit; roll the step back and admit it again")
            streams = order  # type: ignore[assignment]  # none is None
        graph_tokens = ctx.graph_tokens  # None iff ctx.bucket is None (an eager step)
        if graph_tokens is not None:
            if len(kvs.labels) != 1:
                raise InputError(f"a graph step (bucket {ctx.bucket}) has one label; this one has {list(kvs.labels)}")
            n = kvs.uniform_tokens
            self._check_graph_step(graph_tokens, sum(kvs.token_counts) if n is None else n * len(kvs.spans))
        self.table.prepare()
        n = kvs.uniform_tokens
        groups = kvs.label_rows
        layouts = []
        spans: Sequence[KVSpan]
        for label, idx in groups:
            if len(groups) == 1:
                spans, sts, counts = kvs.spans, streams, kvs.token_counts
            else:
                spans = [kvs.spans[i] for i in idx]
                sts = [streams[i] for i in idx]
                counts = tuple(kvs.token_counts[i] for i in idx)
            if b is not None:
                state = b.state()
            else:
                state = row_state(sts)
                if len(groups) == 1:  # kept for the next steps over these streams
                    b = rec.batch = self._batch = RowBatch(kvs.keys(), sts, state, ps, self._epoch)
            lay = build_layout(self.table, spans, state, counts if n is None else n, ps, self.device)
            if graph_tokens is not None:
                self._stage_graph(lay, ctx.slot, graph_tokens)
            layouts.append((label, lay))
        plan = KVPlan(tuple(layouts), ps)
        rec.plans.append(plan)
        self._live_plans[id(plan)] = plan
        self._current = plan
        return plan

    def is_live(self, plan: object) -> bool:
        """Whether ``plan`` is one of this manager's plans whose step is still in flight (admitted,
        neither committed nor rolled back): what may be written and read through."""
        return id(plan) in self._live_plans

    def _check_graph_step(self, padded: int, tokens: int) -> None:
        """``tokens`` of a graph step, padded to ``padded`` (bucket x query tokens per row)."""
        if self._graph_bufs is None or self._sink_page is None:
            raise StateError("a graph step needs build_accelerator_graph_buffers first")
        size = self._graph_bufs.shape[2]
        if tokens > padded or padded > size:
            raise InputError(f"graph step: {tokens} tokens padded to {padded}; static buffers hold {size}")

    def _stage_graph(self, lay: LabelLayout, slot: int, padded: int) -> None:
        """Graph step: the per-token arrays (pages / slots / positions) into ``slot``'s static
        buffers, which the captured graph reads, padded to ``padded`` tokens (bucket x query
        tokens per row; padding writes go to the sink page, at position 0); ``lay.per_token``
        becomes their views. A decode step takes two device operations (its pages gathered
        from ``kv_indices`` straight into the buffer, its slots and positions copied), and one
        more for padding, all in stream order after the replay that last read the slot."""
        assert self._graph_bufs is not None and self._pad_cols is not None
        n = lay.num_tokens
        pack, dev = lay.pack, lay.rows_device
        assert pack is not None and dev is not None
        host = self.table.on_host and pack.decode  # a CPU's buffers are host memory: numpy writes them
        views = self._graph_views.get((slot, n, padded, host))
        if views is None:  # a few views per (slot, tokens, padding), made once
            buf: Any = self._graph_bufs[slot]  # [3, max_bs]
            pad_src: Any = self._pad_cols[:, : padded - n]
            if host:
                buf, pad_src = buf.numpy(), pad_src.numpy()
            views = self._graph_views[(slot, n, padded, host)] = (
                buf[:, :n], buf[0, :n], buf[1:, :n], buf[:, n:padded], pad_src,
                dict(zip(TOKEN_ARRAYS, self._graph_bufs[slot, :, :padded].unbind(0), strict=True)))
        block, pages, rest, pad, pad_src, per_token = views
        if host:
            a = dev.numpy()
            np.take(lay.kv_indices.numpy(), pack.last_index(a), out=pages)
            np.copyto(rest, pack.slots_and_positions(a))
            if n < padded:
                np.copyto(pad, pad_src)
        else:
            if pack.decode:
                torch.index_select(lay.kv_indices, 0, pack.last_index(dev), out=pages)
                rest.copy_(pack.slots_and_positions(dev))
            else:
                block.copy_(torch.stack(token_arrays(self.table, pack, dev, n, self.config.page_size)))
            if n < padded:
                pad.copy_(pad_src)
        lay.per_token.update(per_token)

    def build_accelerator_graph_buffers(self, slots: int, max_bs: int, max_seq_len: int) -> None:
        """Static per-slot buffers for the tokens of a graph step of ``max_bs`` rows (times the
        features' query tokens per decode row), and one sink page taken from the pool for padding
        rows' writes. Grow-only: a smaller call keeps what exists. Graphs must be captured after
        the last call (a larger call moves the buffers)."""
        max_bs *= self.features.decode_query_tokens
        if self._sink_page is None:
            if self.pool.num_free < 1:
                raise StateError("build_accelerator_graph_buffers: no free page left for the sink page")
            self._sink_page = self.pool.take(1)[0]
        cur = self._graph_bufs
        if cur is not None and cur.shape[0] >= slots and cur.shape[2] >= max_bs:
            return
        slots = max(slots, cur.shape[0] if cur is not None else 0)
        max_bs = max(max_bs, cur.shape[2] if cur is not None else 0)
        self._graph_bufs = torch.zeros((slots, 3, max_bs), dtype=torch.int32, device=self.device)
        # what padding tokens hold: the sink page, offset 0, position 0
        self._pad_cols = torch.zeros((3, max_bs), dtype=torch.int32, device=self.device)
        self._pad_cols[0] = self._sink_page
        self._graph_views.clear()  # views of the buffers just replaced

    def can_capture(self) -> bool:
        """Yes: graph steps plan into the static per-slot buffers that
        ``build_accelerator_graph_buffers`` makes (a graph step before it is an error)."""
        return True

    @property
    def supports_preplan(self) -> bool:
        # eager plans allocate fresh tensors and graph plans write their own slot: planning
        # step N+1 never touches what step N reads
        return True

    @property
    def sink_page(self) -> int | None:
        """The page padding rows of graph steps write to (None outside graph mode)."""
        return self._sink_page

    @property
    def current(self) -> KVPlan:
        """What ``write_kv`` writes through: the plan of the step whose forward a runner is
        running (:meth:`Node.bound`), else the latest plan."""
        plan = self.bound_plan()
        if plan is None:
            plan = self._current
        if plan is None or id(plan) not in self._live_plans:
            raise StateError(f"{self.name}: no step is planned (none yet, or its step was committed or rolled "
                             "back): admit and plan a step before write_kv or run")
        return plan

    def commit(self, step: Step, ctx: StepContext) -> None:
        """Advance ``commit=True`` spans' length and release pages held only for ``commit=False``
        tokens. A span whose stream was reset or removed after the admit is dropped: its
        pages went back to the pool with the reset, so there is nothing to commit to."""
        ps = self.config.page_size
        rec = self._record(ctx, step, "commit")
        if not rec.plans:
            raise StateError(f"{self.name}: commit of streams {list(step.kv.keys())}, admitted but never planned: "
                             "plan the step (and run its forward) before commit, or roll it back")
        del ctx.admitted[self.name]  # consumed: a second commit or a rollback finds nothing
        self._land(rec)
        kvs = step.kv
        n = kvs.uniform_tokens
        b = self._kept(rec, step)
        self._epoch += 1
        if b is not None and n is not None and kvs.all_commit:
            self._commit_kept(b, n)
            if self._publishing:
                self._publish()
            return
        order, current = self._admitted_streams(rec, step)
        trim: list[CacheStream] = []
        if n is not None and current and kvs.all_commit:
            # every span commits its n tokens to the stream it admitted: one plain pass
            live: list[CacheStream] = order  # type: ignore[assignment]  # none is None
            for st in live:
                st.in_flight = False
                st.length += n
            # pages held beyond the new length (len(pages) > pages_for(length))
            trim = [st for st in live if len(st.pages) * ps >= st.length + ps]
        else:
            for s, cur in zip(kvs.spans, order, strict=True):
                if cur is None:
                    log.info("commit: stream (%r, %r) was reset or removed after admit; its span is dropped",
                             s.request_id, s.label)
                    self._unpark(rec.streams[(s.request_id, s.label)])
                    continue
                cur.in_flight = False
                if s.commit:
                    cur.length += s.num_tokens
                if len(cur.pages) > pages_for(cur.length, ps):
                    trim.append(cur)
        for st in trim:
            # Pages held only for commit=False tokens: nothing will read them again.
            keep = pages_for(st.length, ps)
            self.pool.give_back(st.pages[keep:])
            # A new list, not the old one cut: plans made before hold the old one (SpanLayout
            # .source) and stay readable. A C-level copy of the kept entries, and only on this
            # path (tokens held without commit).
            st.pages = st.pages[:keep]
        if self._publishing:
            self._publish()  # only committed tokens: a step rolled back never gets here

    def _commit_kept(self, b: RowBatch, n: int) -> None:
        """``commit`` of the kept rows' step, every span keeping its ``n`` tokens: the streams and
        the kept arrays advance together."""
        for st in b.streams:
            st.in_flight = False
            st.length += n
        b.committed += n
        b.slack -= n
        b.in_flight = False
        ps = self.config.page_size
        # rows holding pages past their new length (len(pages) > pages_for(length)): none, unless
        # a stream came into the rows holding extra pages
        over = np.flatnonzero(b.slack >= ps).tolist()
        if over:
            b.sources = list(b.sources)  # the plans made so far keep the lists they read
            for i in over:
                st = b.streams[i]
                keep = pages_for(st.length, ps)
                self.pool.give_back(st.pages[keep:])
                st.pages = st.pages[:keep]  # a new list, as in commit
                b.sources[i] = st.pages
                b.slack[i] = keep * ps - st.length
        b.epoch = self._epoch

    # -- data --------------------------------------------------------------------------------
    def check_layer(self, layer_idx: int) -> int:
        n = self.config.num_layers
        if not is_int(layer_idx) or not 0 <= layer_idx < n:
            # -1 too: it would silently address the last layer
            raise InputIndexError(f"{self.name}: layer_idx {layer_idx!r} out of range: this cache holds layers "
                                  f"0..{n - 1}")
        return layer_idx

    def layer_view(self, layer_idx: int) -> torch.Tensor:
        """``[max_pages, 2, page_size, H_kv, D]``: the layout FlashInfer's NHD kernels read."""
        return self.storage[self.check_layer(layer_idx)]

    def check_layer_view(self, view: Any, layer_idx: int, who: str) -> None:
        """``view`` must be ``layer_view(layer_idx)`` (checked layer): a run that reads one
        layer's pages with another layer's window or FP8 scales is refused, naming both layers.
        Pointer arithmetic on the host (no device work, capture-safe)."""
        s = self.storage
        if not isinstance(view, torch.Tensor):
            raise InputTypeError(f"{who}: kv_cache_layer must be a tensor, layer_view({layer_idx}), got "
                                 f"{type(view).__name__}")
        size = s.stride(0) * s.element_size()  # bytes per layer
        off = view.data_ptr() - s.data_ptr()
        if off == layer_idx * size and view.shape == s.shape[1:] and view.dtype == s.dtype:
            return
        if view.shape == s.shape[1:] and view.dtype == s.dtype and off % size == 0 and 0 <= off // size < len(s):
            raise InputError(f"{who}: kv_cache_layer is layer {off // size}'s view (layer_view({off // size})), but "
                             f"layer_idx is {layer_idx}; pass layer_view({layer_idx}) with layer_idx={layer_idx}")
        raise InputError(f"{who}: kv_cache_layer ({tuple(view.shape)}, {view.dtype}) is not a layer of this KV "
                         f"cache; pass layer_view({layer_idx}) with layer_idx={layer_idx}")

    def scales(self, layer_idx: int) -> tuple[float | None, float | None]:
        """``(k_scale, v_scale)`` a kernel reads ``layer_idx``'s FP8 pages with; ``(None, None)``
        when the cache holds the model dtype."""
        layer = self.check_layer(layer_idx)
        return (None, None) if self._scales is None else self._scales[layer]

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, label: str | None = None) -> None:
        """Write this step's ``k``/``v`` (``[tokens, H_kv, D]``, packed in plan order) for
        ``label`` at the locations the current plan computed; an FP8 cache stores
        ``k / k_scale`` (:func:`~mstar_core.kv.fp8.quantize`). Under ``torch.compile`` this is the
        op ``mstar::write_kv`` (:mod:`mstar_core.ops`)."""
        if torch.compiler.is_compiling():
            ops.write_kv(k, v, self.storage, self.op_handle, layer_idx, label or "")
            return
        self.write_kv_into(self.storage, k, v, layer_idx, label)

    def write_kv_into(self, storage: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                      label: str | None) -> None:
        """:meth:`write_kv` into ``storage``: the cache, or the copy of it a compiled graph passed."""
        lay = self.current.layout(label)
        # rows = the step's tokens, or the graph bucket they were padded to
        want = (lay.write_pages.numel(), self.config.num_kv_heads, self.config.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise InputError(f"write_kv: {name} has shape {tuple(t.shape)}, expected {want} [tokens, H_kv, D]")
            if t.device != self.storage.device:
                raise InputError(f"write_kv: {name} is on {t.device}, the cache on {self.storage.device}")
        self.store(layer_idx, lay.write_pages, lay.write_offsets, k, v, storage)

    def store(self, layer_idx: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, storage: torch.Tensor | None = None) -> None:
        """``k``/``v`` ``[tokens, H_kv, D]`` into ``layer_idx``'s slots ``(pages, offsets)``, in
        the cache's dtype: an FP8 cache stores ``k / k_scale`` (:func:`~mstar_core.kv.fp8.quantize`).
        ``write_kv`` writes a plan's locations through it; ``storage``: the cache (default) or the
        copy of it a compiled graph passed."""
        i = self.check_layer(layer_idx)
        layer = (self.storage if storage is None else storage)[i]
        if self._scales is not None:
            k_scale, v_scale = self._scales[i]
            k, v = quantize(k, k_scale, self.kv_dtype), quantize(v, v_scale, self.kv_dtype)
        layer[pages, 0, offsets] = k.to(self.kv_dtype)
        layer[pages, 1, offsets] = v.to(self.kv_dtype)

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    def post_warmup_validate(self) -> None:
        """Page accounting is consistent, and (given a tensor-parallel group) every rank of it has
        the same free pages, streams and tokens held: ranks that disagree would admit different
        steps."""
        owned = [p for s in (*self.streams.values(), *self._parked.values()) for p in s.pages]
        if self._sink_page is not None:
            owned.append(self._sink_page)
        if isinstance(self.pool, PrefixCache):
            self.pool.check(owned)  # shared pages are owned once per holder
        elif len(owned) != len(set(owned)) or set(owned) != set(self.pool.used):
            raise StateError(
                f"KVManager page accounting broken: {len(owned)} owned by streams "
                f"({len(set(owned))} distinct), {len(self.pool.used)} marked used"
            )
        ps = self.config.page_size
        short = {k: (len(s.pages), s.length) for k, s in self.streams.items() if len(s.pages) < pages_for(s.length, ps)}
        if short:
            raise StateError(f"KVManager: streams hold fewer pages than their length needs (pages, length): {short}")
        if self.tp is not None:
            same = {"free pages": self.pool.num_free, "streams": len(self.streams),
                    "tokens": sum(s.length for s in self.streams.values())}
            if isinstance(self.pool, PrefixCache):  # every rank must find the same prefixes
                same.update({"cached pages": self.pool.cached, "tokens found cached": self.pool.stats.hit_tokens})
            self.tp.check_same(self.name, same)

    def cleanup(self) -> None:
        self._epoch += 1
        self.streams.clear()
        self._parked.clear()
        self._requests.clear()
        self._publishing.clear()
        self._matched.clear()
        self.pool = self._new_pool()
        self.storage = self.storage.new_empty(0)
        self._current = None
        self._live_plans.clear()
        self._graph_bufs = self._pad_cols = None
        self._graph_views.clear()
        self._resolved = None
        self._batch = None
        self._sink_page = None
        self.table = PageTable(self.device, self.config.max_pages)
