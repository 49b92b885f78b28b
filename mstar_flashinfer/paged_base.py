"""What the paged prefill and decode wrappers share: building (from a ``WrapperSize``, or the
loose constructor), static buffers for graph mode, staging, the plan-state kept for KV write
locations, and ``run``.

A plan arrives as the core's ``PagedPlan``, checked once there (the loose ``plan(...)`` builds
one with ``paged_plan``); what is refused here is what FlashInfer itself cannot compute or hold.

Graph mode (``accelerator_graph=True``): the index buffers FlashInfer reads are allocated here,
once, and handed to FlashInfer's wrapper with ``use_cuda_graph=True``; ``plan`` only updates them
in place (``.copy_()``), so a graph captured over ``run`` replays with whatever the latest plan
wrote. The same wrapper object must be used at capture and at every replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self

import numpy as np
import torch

from mstar_core.plugin import (
    InputError,
    PagedPlan,
    StateError,
    WrapperSize,
    check_same_device,
    check_scale,
)
from mstar_flashinfer import compat
from mstar_flashinfer.head_dim import check_flashinfer_head_dim
from mstar_flashinfer.jit_notice import plan_first_use
from mstar_flashinfer.kv_write import KVWriteLocations, to_device, write_locations
from mstar_flashinfer.library import flashinfer
from mstar_flashinfer.nvtx import Nvtx
from mstar_flashinfer.refusals import refuse_page_range, require
from mstar_flashinfer.sink_variant import build, resolve_backend
from mstar_flashinfer.sinks import SinkPlan, sink_run
from mstar_flashinfer.staging import Staging


def plan_extras(plan: PagedPlan) -> dict[str, Any]:
    """FlashInfer's plan keywords from a plan's; K/V scales go to ``run``."""
    return {"sm_scale": plan.sm_scale, "logits_soft_cap": plan.logits_soft_cap, "q_data_type": plan.dtype,
            "kv_data_type": plan.kv_data_type or plan.dtype}


def run_extras(who: str, k_scale: float | None, v_scale: float | None, sinks: torch.Tensor | None,
               sink_plan: SinkPlan | None, num_qo_heads: int, device: torch.device,
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """FlashInfer's run arguments after ``(q, paged_kv_cache)``: the K/V scales of FP8 storage as
    keywords; after a sink plan, the sink variant's ``(sink, sm_scale)`` positionally (``k_scale``
    folded into that scale, as its jit path drops the keyword) and ``v_scale`` (applied after it)."""
    check_scale(k_scale, "k_scale", f"{who}.run")
    check_scale(v_scale, "v_scale", f"{who}.run")
    sink_run(who, sink_plan, sinks, num_qo_heads, device)
    if sink_plan is None:
        return (), {"k_scale": k_scale, "v_scale": v_scale}
    assert sinks is not None  # sink_run refuses a sink plan's run without them
    return sink_plan.run_args(sinks, k_scale), {"v_scale": v_scale}


# Page indices: a host array, or a tensor on the device (the paged manager gathers them there).
Indices = np.ndarray | torch.Tensor
# What a loose ``plan`` takes for each index array: a tensor (kv_indices may be on the device),
# a numpy array or a list of ints.
PlanArray = torch.Tensor | np.ndarray | list[int]


class Rows(NamedTuple):
    """One plan's arrays as FlashInfer's plan takes them (before graph padding): host int32 views
    of the plan's tensors (no copy), ``indices`` a device tensor where the plan holds one."""

    qo: np.ndarray
    indptr: np.ndarray
    indices: Indices
    last: np.ndarray
    lens: np.ndarray
    max_page: int  # the largest page index read; -1 where unknown (device indices)


def rows_of(plan: PagedPlan) -> Rows:
    """The plan's rows; page indices past ``kv_indptr[-1]`` (read by no row) are left out, so
    padding rows appended after them read the sink page."""
    indptr, idx = plan.kv_indptr.numpy(), plan.kv_indices
    used = int(indptr[-1])
    if idx.shape[0] != used:
        idx = idx[:used]
    return Rows(plan.qo_indptr.numpy(), indptr, idx.numpy() if idx.is_cpu else idx, plan.kv_last_page_len.numpy(),
                plan.kv_lens.numpy(), plan.max_page)


@dataclass
class PlanState:
    """A plan's host arrays (the caller's rows, before any padding), for write locations."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: Indices  # a device tensor where the caller gave one
    kv_lens: np.ndarray
    tokens: int
    locations: KVWriteLocations | None = field(default=None)
    # The largest page index the plan (padding included) reads, -1 for none: ``run`` refuses a
    # cache with fewer pages (one int compare, no device sync).
    max_page: int = -1


def pad_rows(rows_to: int, r: Rows, sink_page: int) -> tuple[np.ndarray, np.ndarray, Indices, np.ndarray, np.ndarray]:
    """Pad a plan to ``rows_to`` rows: each extra row has no query and one key (the first slot of
    ``sink_page``), so it is cheap, valid for every kernel, and its output is never read. Device
    indices are left as they are: :meth:`PagedWrapperBase._stage_indices` pads them in place."""
    pad = rows_to - (r.indptr.shape[0] - 1)
    if pad <= 0:
        return r.qo, r.indptr, r.indices, r.last, r.lens
    one = np.ones(pad, dtype=np.int32)
    qo = np.concatenate([r.qo, np.full(pad, r.qo[-1], dtype=np.int32)])
    indptr = np.concatenate([r.indptr, r.indptr[-1] + np.cumsum(one, dtype=np.int32)])
    indices = r.indices
    if isinstance(indices, np.ndarray):
        indices = np.concatenate([indices, np.full(pad, sink_page, dtype=np.int32)])
    return qo, indptr, indices, np.concatenate([r.last, one]), np.concatenate([r.lens, one])


class PagedWrapperBase:
    """Shared by :class:`FlashInferPrefillWrapper` and :class:`FlashInferDecodeWrapper`."""

    kind = "paged"
    # Padding rows (graph mode, fewer rows than batch_size) read one token of this page; any page
    # of the layer would do, since their output is never read, and page 0 always exists.
    SINK_PAGE = 0

    def __init__(
        self,
        workspace_buffer: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int | None,
        max_total_tokens: int | None,
        max_num_pages: int | None,
        device: torch.device | str,
        accelerator_graph: bool,
        enable_nvtx: bool,
        backend: str,
    ) -> None:
        # The loose constructor: the core's WrapperSize checks the geometry; the head dim is
        # checked against the one declaration (the registry checks it for from_size's callers).
        size = WrapperSize(num_qo_heads, num_kv_heads, head_dim, torch.device(device), page_size, batch_size=batch_size,
                           max_total_tokens=max_total_tokens, max_num_pages=max_num_pages,
                           accelerator_graph=bool(accelerator_graph), options={"backend": backend})
        check_flashinfer_head_dim(head_dim, size.device)
        self._init(size, workspace_buffer, enable_nvtx)

    @classmethod
    def from_size(cls, size: WrapperSize) -> Self:
        """Contract 2.0: a wrapper for ``size``, its workspace made here and FlashInfer's
        ``backend`` read from ``size.options`` (the registry has checked head dim and dtypes)."""
        w = cls.__new__(cls)
        w._init(size, cls._workspace(size), False)
        return w

    @classmethod
    def _workspace(cls, size: WrapperSize) -> torch.Tensor:
        return size.workspace()

    def _init(self, size: WrapperSize, workspace_buffer: torch.Tensor, enable_nvtx: bool) -> None:
        if size.page_size < 1:
            raise InputError(f"{type(self).__name__}: page_size must be an int >= 1 (FlashInfer takes any page size), "
                             f"got {size.page_size!r}")
        self.device = size.device
        self.num_qo_heads, self.num_kv_heads, self.head_dim = size.num_qo_heads, size.num_kv_heads, size.head_dim
        self.page_size = size.page_size
        self.backend = str(size.options.get("backend", "auto"))
        self.accelerator_graph = size.accelerator_graph
        self.workspace_buffer = workspace_buffer
        self.batch_size = size.batch_size
        self.max_total_tokens = size.max_total_tokens
        self.max_num_pages = size.max_num_pages
        self._staging = Staging(self.device)
        self._nvtx = Nvtx(f"mstar.flashinfer.{self.kind}", enable_nvtx, self.device)
        self._state: PlanState | None = None
        self._static_q: int | None = None  # graph mode: the q rows a captured run sees
        self._static_only = False  # True where the kernel reads every static row (graph decode)
        self._inner: Any = None  # FlashInfer's wrapper the latest plan planned
        self._sink_plan: SinkPlan | None = None  # the latest plan's, where it said sink_logits=True
        # The sink variant's wrappers (FlashInfer's paged prefill, JIT variant), built on first use
        # per (backend, query dtype, sliding window or not): the window switch is compiled in.
        self._sink_inners: dict[tuple[str, torch.dtype, bool], Any] = {}

    # -- build ---------------------------------------------------------------------------------
    def _graph_buffers(self, with_qo: bool) -> dict[str, torch.Tensor]:
        why = f"for {type(self).__name__} with accelerator_graph=True"
        b = require("batch_size", self.batch_size, why)
        p = require("max_num_pages", self.max_num_pages, why)
        i32, dev = torch.int32, self.device
        bufs = {
            "kv_indptr": torch.zeros(b + 1, dtype=i32, device=dev),
            "kv_indices": torch.zeros(p, dtype=i32, device=dev),
            "last_page_len": torch.ones(b, dtype=i32, device=dev),
        }
        if with_qo:
            bufs["qo_indptr"] = torch.zeros(b + 1, dtype=i32, device=dev)
        self._staging.reserve({"rows": 4 * b + 2, "kv_indices": p})
        return bufs

    def _sink_inner(self, backend: str, dtype: torch.dtype, window_left: int, graph: dict[str, torch.Tensor] | None,
                    rows: int) -> Any:
        """The sink variant's wrapper for a plan (built on first use); ``graph``: the static
        buffers it shares with the other wrappers of this one (graph mode), ``rows`` its token budget."""
        backend = resolve_backend(backend, self.device, dtype, dtype)
        key = (backend, dtype, window_left >= 0)
        inner = self._sink_inners.get(key)
        if inner is None:
            # The variant's module is built (or compiled, 20-120 s) as its wrapper is made: announced.
            with plan_first_use("paged attention (sink logits)", dtype, dtype, self.head_dim, window_left, None,
                                backend):
                inner = build(flashinfer(), self.workspace_buffer, backend, dtype, dtype, self.head_dim,
                              window_left >= 0, graph, rows)
            self._sink_inners[key] = inner
        return inner

    # -- plan helpers --------------------------------------------------------------------------
    def _device_indices(self, plan: PagedPlan, who: str) -> None:
        """Page indices on a device must be on this wrapper's (the core does not know it)."""
        idx = plan.kv_indices
        if not idx.is_cpu:
            check_same_device(who, self.device, kv_indices=idx)

    def _check_graph_fit(self, rows: int, tokens: int, r: Rows) -> None:
        """Refuse a plan the static buffers cannot hold, naming the limit (FlashInfer's own
        errors do not say which buffer or by how much), then a page index past them."""
        pages = r.indices.shape[0]
        name = type(self).__name__
        assert self.batch_size is not None and self.max_num_pages is not None
        if rows > self.batch_size:
            raise InputError(f"{name}.plan: {rows} rows exceed batch_size={self.batch_size} of the static buffers")
        pad = self.batch_size - rows
        if pages + pad > self.max_num_pages:
            raise InputError(
                f"{name}.plan: {pages} pages (+{pad} padding rows) exceed max_num_pages={self.max_num_pages} "
                "of the static buffers"
            )
        if self.max_total_tokens is not None and tokens > self.max_total_tokens:
            raise InputError(
                f"{name}.plan: {tokens} tokens exceed max_total_tokens={self.max_total_tokens} of the static buffers"
            )
        if r.max_page >= self.max_num_pages and isinstance(r.indices, np.ndarray):
            refuse_page_range(f"{name}.plan", r.indices, self.max_num_pages)

    @staticmethod
    def _stage_rows(st: Staging, arrays: tuple[np.ndarray, ...]) -> list[torch.Tensor]:
        """The plan's per-row host arrays staged in one page-locked buffer of this slot; views in
        the same order."""
        return st.put_many("rows", arrays)

    def _stage_indices(self, indices: Indices, bufs: dict[str, torch.Tensor] | None, pad: int = 0) -> torch.Tensor:
        """The page indices as FlashInfer's plan should receive them. In graph mode they are
        copied here into the static buffer (asynchronously from the pinned slot, or device to
        device), and FlashInfer is handed that very view: its own
        ``buf[:n].copy_(indices, non_blocking=<same device>)`` is then a copy of a tensor onto
        itself, which torch skips -- a host array there would be a blocking copy, i.e. a device
        sync in every plan. ``pad``: padding rows whose sink page device indices still lack
        (host ones have them already, from :func:`pad_rows`)."""
        if isinstance(indices, torch.Tensor):  # on the device already
            if bufs is None:
                return indices
            n = indices.shape[0]
            view = bufs["kv_indices"][: n + pad]
            view[:n].copy_(indices)
            if pad:
                view[n:].fill_(self.SINK_PAGE)
            return view
        staged = self._staging.put("kv_indices", indices)
        if bufs is None:
            return staged
        view = bufs["kv_indices"][: indices.shape[0]]
        self._staging.copy(view, staged)
        return view

    def _plan_slot(self, keep: Rows, tokens: int, max_page: int) -> _PlanSlot:
        """One plan's staging slot, around staging the host arrays and FlashInfer's own ``plan``.
        On success the plan's rows ``keep`` become this wrapper's state. A plan refused by our
        checks before this leaves the previous plan whole (FlashInfer still holds it); one that
        fails in here may have changed FlashInfer's state, so ours is dropped and ``run`` says
        "before plan". Either way the copies already issued from the slot are fenced."""
        return _PlanSlot(self, keep, tokens, max_page)

    # -- outputs -------------------------------------------------------------------------------
    def kv_write_locations(self) -> KVWriteLocations:
        """Where this plan's tokens are written in the paged cache (the last ``q_len`` positions
        of each row), computed on first request from the plan's host arrays."""
        st = self._state
        if st is None:
            raise StateError(f"{type(self).__name__}.kv_write_locations before plan")
        if st.locations is None:
            indices = st.kv_indices
            if isinstance(indices, torch.Tensor):  # given on the device: read back once, on request
                indices = indices.cpu().numpy()
            pages, offs = write_locations(st.qo_indptr, st.kv_indptr, indices, st.kv_lens, self.page_size)
            st.locations = to_device(pages, offs, self.device)
        return st.locations

    @property
    def planned_tokens(self) -> int:
        if self._state is None:
            raise StateError(f"{type(self).__name__} has no plan yet")
        return self._state.tokens

    def _out(self, q: torch.Tensor) -> torch.Tensor:
        """The output of a run, uninitialised: FlashInfer 0.7's paged prefill zero-fills one it
        allocates itself (an extra kernel per run); every row is written by the kernel or unread."""
        return torch.empty(q.shape[0], self.num_qo_heads, self.head_dim, dtype=q.dtype, device=q.device)

    def _run_kernel(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, out: torch.Tensor, k_scale: float | None,
                    v_scale: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """FlashInfer's run of the latest plan into ``out`` (q and the cache checked by the caller)."""
        args, kw = run_extras(type(self).__name__, k_scale, v_scale, sinks, self._sink_plan, self.num_qo_heads,
                              self.device)
        if args and self._static_q is not None:  # the sink variant is a paged prefill: its q rows as checked
            compat.tell_q_rows(self._inner, q.shape[0])
        return self._inner.run(q, kv_cache_layer, *args, out=out, **kw)

    def _check_run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor) -> None:
        st = self._state
        if st is None:
            raise StateError(f"{type(self).__name__}.run before plan")
        n = q.shape[0]
        if n != self._static_q and (n != st.tokens or self._static_only):
            want = (f"{self._static_q} (static)" if self._static_only else f"{st.tokens}" if self._static_q is None
                    else f"{st.tokens} (planned) or {self._static_q} (static)")
            raise InputError(f"{type(self).__name__}.run: q has {n} rows, expected {want}")
        check_run_cache(type(self).__name__, self.device, q, kv_cache_layer, st.max_page, self.page_size,
                        self.num_kv_heads, self.head_dim)


class _PlanSlot:
    """:meth:`PagedWrapperBase._plan_slot` (a class: a generator-based context manager costs
    several times more, on every plan)."""

    __slots__ = ("keep", "max_page", "tokens", "wrapper")

    def __init__(self, wrapper: PagedWrapperBase, keep: Rows, tokens: int, max_page: int) -> None:
        self.wrapper, self.keep, self.tokens, self.max_page = wrapper, keep, tokens, max_page

    def __enter__(self) -> Staging:
        st = self.wrapper._staging
        st.begin()
        return st

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        w = self.wrapper
        try:
            if exc_type is None:
                k = self.keep
                w._state = PlanState(k.qo, k.indptr, k.indices, k.lens, self.tokens, max_page=self.max_page)
            else:
                w._state = None
        finally:
            w._staging.end()


def check_run_cache(name: str, device: torch.device, q: torch.Tensor, kv_cache_layer: torch.Tensor, max_page: int,
                    page_size: int, num_kv_heads: int, head_dim: int) -> None:
    """``run``'s cheap checks of the cache: its layout, q on its device, and enough pages for the
    largest index the plan reads (kept from plan: an int compare, no device sync)."""
    who = f"{name}.run"
    check_same_device(who, device, kv_cache_layer=kv_cache_layer, q=q)
    if kv_cache_layer.dim() != 5 or kv_cache_layer.shape[2] != page_size:
        raise InputError(
            f"{who}: kv_cache_layer has shape {tuple(kv_cache_layer.shape)}, expected "
            f"[max_pages, 2, {page_size}, {num_kv_heads}, {head_dim}]"
        )
    if max_page >= kv_cache_layer.shape[0]:
        raise InputError(
            f"{who}: the plan reads page {max_page} but kv_cache_layer has {kv_cache_layer.shape[0]} pages "
            f"(page indices must be < {kv_cache_layer.shape[0]}); plan with this cache's page indices"
        )
