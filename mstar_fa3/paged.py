"""FA3's paged prefill, decode and mixed wrappers: ``flash_attn_interface.flash_attn_with_kvcache``
over mstar's KV layout, as it is.

A layer is ``[pages, 2, page_size, kv_heads, head_dim]``; its K and V are the strided views
``layer[:, 0]`` and ``layer[:, 1]`` (page stride ``2 * page_size * kv_heads * head_dim``), which the
kernel reads without a copy: it needs a unit stride in the last dimension only and takes the
page stride from the tensor. mstar plans rows as page lists (``kv_indptr`` / ``kv_indices``); the
kernel takes a padded ``page_table [rows, width]``, built on the device at plan by one scatter
(no host pass over the pages), ``cache_seqlens`` (each row's keys, this step's included: the KV
manager writes them before attention) and, for prefill and mixed steps, ``cu_seqlens_q`` and
``max_seqlen_q``. Its causal mask is bottom-right aligned, which is where a row's queries sit.

Pre-planning: ``plan`` also computes the kernel's tile schedule (``get_scheduler_metadata``) once
per step, so each layer's call skips that work. Graph mode (``accelerator_graph=True``): every
tensor the kernel reads is a static buffer that ``plan`` rewrites in place; the page table is
``batch_size x max_num_pages`` wide (no row can hold more pages), padding rows have no keys and
return zeros, and the split count is fixed (the schedule shrinks it per row).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ClassVar, Self

import torch

from mstar_core.plugin import (
    MIXED,
    PAGED_DECODE,
    PAGED_PREFILL,
    InputError,
    InputTypeError,
    PagedPlan,
    RaggedPlan,
    StateError,
    Unsupported,
    WrapperSize,
    check_same_device,
    check_scale,
    check_sinks,
    is_int,
    paged_plan,
)
from mstar_fa3.plugin import FA3

MODULE = "flash_attn_interface"
# What FA3 computes, as its one declaration (the BackendSpec) says: checked for a wrapper built
# or planned through the loose form; the registry enforces it for from_size's callers.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(FA3.dtypes)
MAX_HEAD_DIM = FA3.head_dims.maximum or 256
# hopper's flash_api checks "sinks must have dtype bfloat16"
SINKS_DTYPE = torch.bfloat16
# Graph mode fixes the split count at capture (the host heuristic would see the static page table's
# full width); the precomputed schedule gives each row at most this many.
GRAPH_NUM_SPLITS = 16
# The keywords a loose paged plan takes beyond its layout (FlashInfer's names).
PLAN_KEYWORDS = ("sm_scale", "logits_soft_cap", "kv_data_type", "sink_logits")


def given_plan(first: Any, rest: bool, kind: str, who: str) -> PagedPlan | None:
    """The plan object ``plan`` was given (contract 2.0), or None for the loose form; one of
    another capability, or with other arguments beside it, is refused."""
    if not isinstance(first, (PagedPlan, RaggedPlan)):
        return None
    got = first.kind if isinstance(first, PagedPlan) else "prefixed_ragged"
    if got != kind:
        raise InputError(f"{who}: got a {got} plan; this wrapper runs {kind} plans")
    if rest:
        raise InputTypeError(f"{who}: a plan object comes alone; got other arguments with it")
    assert isinstance(first, PagedPlan)
    return first


class FA3PagedWrapper:
    """What the three share: build-time checks, the plan (page table, lengths, schedule) and
    ``run``. Subclasses say how rows and queries are laid out."""

    kind: ClassVar[str] = "paged"
    capability: ClassVar[str] = PAGED_PREFILL  # the plan kind it runs
    graph_capturable: ClassVar[bool] = True

    def __init__(
        self,
        workspace_buffer: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int | None = None,
        max_total_tokens: int | None = None,
        max_num_pages: int | None = None,
        device: torch.device | str = "cuda",
        accelerator_graph: bool = False,
        enable_nvtx: bool = False,
        backend: str = "auto",
    ) -> None:
        self._init(self._loose_size(num_qo_heads, num_kv_heads, head_dim, page_size, batch_size, max_total_tokens,
                                    max_num_pages, device, accelerator_graph))

    @classmethod
    def _loose_size(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, batch_size: int | None,
                    max_total_tokens: int | None, max_num_pages: int | None, device: torch.device | str,
                    accelerator_graph: bool, query_tokens: int = 1) -> WrapperSize:
        """The loose constructor's size: the core's WrapperSize checks the geometry; the head dim
        is checked against the one declaration."""
        if FA3.head_dims.refusal(head_dim) if is_int(head_dim) else True:
            raise InputError(f"{cls.__name__}: FA3 needs head_dim a multiple of {FA3.head_dims.multiple_of} in "
                             f"{FA3.head_dims.multiple_of}..{MAX_HEAD_DIM}, got {head_dim!r}")
        return WrapperSize(num_qo_heads, num_kv_heads, head_dim, torch.device(device), page_size,
                           batch_size=batch_size, max_total_tokens=max_total_tokens, max_num_pages=max_num_pages,
                           accelerator_graph=bool(accelerator_graph), query_tokens=query_tokens)

    @classmethod
    def from_size(cls, size: WrapperSize) -> Self:
        """Contract 2.0: a wrapper for ``size`` (FA3 takes no workspace: it allocates per call)."""
        w = cls.__new__(cls)
        w._init(size)
        return w

    def _init(self, size: WrapperSize) -> None:
        name = type(self).__name__
        if size.page_size < 1:
            raise InputError(f"{name}: page_size must be a positive int, got {size.page_size!r}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = size.num_qo_heads, size.num_kv_heads, size.head_dim
        self.page_size = size.page_size
        self.device = size.device
        self.accelerator_graph = size.accelerator_graph
        self.batch_size, self.max_total_tokens, self.max_num_pages = (size.batch_size, size.max_total_tokens,
                                                                      size.max_num_pages)
        if self.accelerator_graph:
            for what, n in (("batch_size", self.batch_size), ("max_num_pages", self.max_num_pages)):
                if not is_int(n) or n is None or n < 1:
                    raise InputError(f"{name} with accelerator_graph=True needs {what} (a positive int), got {n!r}")
        # Imported here, not at module import: the plugin must load where FA3 is not installed.
        fa3 = importlib.import_module(MODULE)
        self._kernel = fa3.flash_attn_with_kvcache
        self._schedule = getattr(fa3, "get_scheduler_metadata", None)  # builds without it: per-call scheduling
        self._static: dict[str, torch.Tensor] | None = None
        self._planned: dict[str, Any] | None = None

    # -- layout, per subclass ----------------------------------------------------------------------
    def _static_q_rows(self) -> int:
        """The q rows a captured run sees."""
        raise NotImplementedError

    def _q_view(self, q: torch.Tensor, rows: int) -> torch.Tensor:
        return q

    # -- plan --------------------------------------------------------------------------------------
    def _loose(self, who: str, qo_indptr: Any, indptr: Any, indices: Any, last: Any, causal: bool,
               dtype: torch.dtype, kv_lens: Any, window_left: int, kwargs: dict[str, Any],
               query_tokens: int = 1) -> PagedPlan:
        """The plan of a loose ``plan(...)`` call, built and checked by the core."""
        unknown = sorted(set(kwargs) - set(PLAN_KEYWORDS))
        if unknown:
            raise InputTypeError(f"{who} got unexpected keyword arguments {unknown}; it accepts {list(PLAN_KEYWORDS)}")
        if dtype not in SUPPORTED_DTYPES:
            raise InputTypeError(f"{who}: FA3 computes in {', '.join(map(str, SUPPORTED_DTYPES))}, got {dtype}")
        return paged_plan(self.capability, qo_indptr, indptr, indices, last, self.page_size, dtype, causal=causal,
                          kv_lens=kv_lens, window_left=window_left, query_tokens=query_tokens, who=who, **kwargs)

    def _plan(self, plan: PagedPlan, who: str) -> None:
        """Plan the kernel for ``plan`` (built and checked by the core): only what FA3 itself cannot
        run is refused here, all before anything changes (a refused plan keeps the previous one)."""
        dtype = plan.dtype
        if plan.kv_data_type is not None and plan.kv_data_type != dtype:
            raise Unsupported(f"{who}: FA3 reads an FP8 cache only with FP8 queries (q, k and v share one dtype); "
                              f"this plan has {dtype} queries over a {plan.kv_data_type} cache")
        decode = plan.kind == PAGED_DECODE
        if not decode and not plan.keys_cover_queries:
            q_lens, lens = plan.q_lens, plan.kv_lens.numpy()
            i = int(((q_lens > lens) if plan.causal else ((q_lens > 0) & (lens == 0))).nonzero()[0][0])
            raise InputError(f"{who}: row {i} has {int(q_lens[i])} queries but {int(lens[i])} keys; a row's "
                             "queries are among its keys")
        indptr_t, indices = plan.kv_indptr, plan.kv_indices
        if not indices.is_cpu:
            check_same_device(who, self.device, kv_indices=indices)
        rows, tokens = plan.rows, plan.tokens
        total_pages = int(indptr_t[-1])
        width = -(-plan.max_kv // self.page_size)  # the most pages a row holds
        st = self._static
        if self.accelerator_graph:
            assert self.batch_size is not None and self.max_num_pages is not None
            if rows > self.batch_size:
                raise InputError(f"{who}: {rows} rows exceed batch_size={self.batch_size} of the static buffers")
            if total_pages > self.max_num_pages:
                raise InputError(f"{who}: {total_pages} pages exceed max_num_pages={self.max_num_pages} of the "
                                 "static buffers")
            static_q = self._static_q_rows()
            if tokens > static_q:
                raise InputError(f"{who}: {tokens} query tokens exceed the static {static_q}")
            if st is None:
                st = self._static = self._static_buffers()
        # -- stage: nothing above changed state --------------------------------------------------
        dev = self.device
        b = self.batch_size if st is not None else rows
        assert b is not None
        # One host array, one copy: [seqlens | pages per row | first page per row | cu_seqlens_q];
        # padding rows have no keys and no pages.
        has_cu = not decode
        packed = torch.zeros(3 * b + (b + 1 if has_cu else 0), dtype=torch.int32, pin_memory=dev.type == "cuda")
        packed[:rows] = plan.kv_lens
        torch.sub(indptr_t[1:], indptr_t[:-1], out=packed[b: b + rows])
        packed[2 * b: 2 * b + rows] = indptr_t[:-1]
        if has_cu:
            packed[3 * b:] = tokens
            packed[3 * b: 3 * b + rows + 1] = plan.qo_indptr
        if st is not None:
            rows_d = st["rows"][: packed.numel()]
            rows_d.copy_(packed, non_blocking=True)
            table = st["page_table"]
        else:
            rows_d = packed.to(dev, non_blocking=True)
            # entries past a row's pages are never read: no fill
            table = torch.empty((max(rows, 1), max(width, 1)), dtype=torch.int32, device=dev)
        seqlens_d, counts_d, starts_d = rows_d[:b], rows_d[b: 2 * b], rows_d[2 * b: 3 * b]
        cu_d = rows_d[3 * b:] if has_cu else None
        if total_pages:
            # page j of row r -> table[r, j], on the device: the row of each page, then its column
            idx = indices[:total_pages].to(dev, non_blocking=True)
            row_of = torch.repeat_interleave(torch.arange(b, device=dev), counts_d, output_size=total_pages)
            col = torch.arange(total_pages, device=dev, dtype=torch.int32) - starts_d.index_select(0, row_of)
            table.index_put_((row_of, col.long()), idx)
        causal = plan.causal
        window_left, soft_cap = plan.window_left, plan.logits_soft_cap
        window = (window_left, 0 if causal else -1) if window_left >= 0 else (-1, -1)
        num_splits = GRAPH_NUM_SPLITS if st is not None else 0
        max_q_static = self._static_q_rows() if st is not None and cu_d is not None else plan.max_q
        meta = None
        if self._schedule is not None:
            meta = self._schedule(
                b, max_q_static, table.shape[1] * self.page_size, self.num_qo_heads, self.num_kv_heads,
                self.head_dim, seqlens_d, qkv_dtype=dtype, cu_seqlens_q=cu_d, page_size=self.page_size,
                causal=causal, window_size=window, has_softcap=soft_cap is not None, num_splits=num_splits)
            if st is not None:
                kept = st.get("schedule")
                if kept is None or kept.shape != meta.shape:
                    # sized by the first plan: its shape depends only on the static batch
                    kept = st["schedule"] = torch.empty_like(meta)
                kept.copy_(meta)
                meta = kept
        self._planned = {
            "rows": rows, "tokens": tokens, "dtype": dtype, "table": table, "seqlens": seqlens_d, "cu": cu_d,
            "max_q": max_q_static, "causal": causal, "window": window, "scale": plan.sm_scale,
            "softcap": soft_cap or 0.0, "splits": num_splits, "meta": meta, "top": plan.max_page,
            "query_tokens": plan.query_tokens,
        }

    def _static_buffers(self) -> dict[str, torch.Tensor]:
        assert self.batch_size is not None and self.max_num_pages is not None
        b, dev = self.batch_size, self.device
        return {"rows": torch.zeros(4 * b + 1, dtype=torch.int32, device=dev),
                "page_table": torch.zeros((b, self.max_num_pages), dtype=torch.int32, device=dev)}

    # -- run ---------------------------------------------------------------------------------------
    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``q [tokens, Hq, D]`` over ``kv_cache_layer [pages, 2, page_size, Hkv, D]``; returns
        ``[tokens, Hq, D]``. ``sinks [Hq]``: a logit per query head in each softmax denominator."""
        who = f"{type(self).__name__}.run"
        p = self._planned
        if p is None:
            raise StateError(f"{who} before plan")
        check_scale(k_scale, "k_scale", who)
        check_scale(v_scale, "v_scale", who)
        if (k_scale not in (None, 1.0)) or (v_scale not in (None, 1.0)):
            raise Unsupported(f"{who}: FA3's paged path has no K/V scales (no FP8 cache under 16-bit queries)")
        n = q.shape[0]
        static = self._static is not None and n == self._static_q_rows()
        if self._static is not None and self.kind == "decode" and not static:
            raise InputError(f"{who}: a graph-mode decode wrapper reads every static row: q must have "
                             f"{self._static_q_rows()} rows, got {n}")
        if q.dim() != 3 or (n != p["tokens"] and not static) or tuple(q.shape[1:]) != (self.num_qo_heads,
                                                                                       self.head_dim):
            want = f"{p['tokens']}" + (f" or {self._static_q_rows()} (static)" if self._static is not None else "")
            raise InputError(f"{who}: q has shape {tuple(q.shape)}, expected [{want}, {self.num_qo_heads}, "
                             f"{self.head_dim}]")
        if q.dtype != p["dtype"]:
            raise InputTypeError(f"{who}: q has dtype {q.dtype}, planned {p['dtype']}")
        want_kv = (2, self.page_size, self.num_kv_heads, self.head_dim)
        if kv_cache_layer.dim() != 5 or tuple(kv_cache_layer.shape[1:]) != want_kv:
            raise InputError(f"{who}: kv_cache_layer has shape {tuple(kv_cache_layer.shape)}, expected "
                             f"[max_pages, {', '.join(map(str, want_kv))}]")
        if p["top"] >= kv_cache_layer.shape[0]:
            raise InputError(f"{who}: the plan reads page {p['top']} but kv_cache_layer has {kv_cache_layer.shape[0]} "
                             "pages; plan with this cache's page indices")
        if kv_cache_layer.dtype != q.dtype:
            raise InputTypeError(f"{who}: kv_cache_layer is {kv_cache_layer.dtype}, q {q.dtype}: FA3 reads one dtype")
        if q.device != kv_cache_layer.device or q.device.type != self.device.type:
            raise InputError(f"{who}: q is on {q.device}, kv_cache_layer on {kv_cache_layer.device}, the plan on "
                             f"{self.device}")
        extra: dict[str, Any] = {}
        if sinks is not None:
            check_sinks(sinks, self.num_qo_heads, q.device, who)
            extra["sinks"] = sinks.to(SINKS_DTYPE).contiguous()
        if p["softcap"]:
            extra["softcap"] = p["softcap"]
        if p["cu"] is not None:
            extra.update(cu_seqlens_q=p["cu"], max_seqlen_q=p["max_q"])
        out = self._kernel(
            self._q_view(q, p["table"].shape[0]), kv_cache_layer[:, 0], kv_cache_layer[:, 1],
            cache_seqlens=p["seqlens"], page_table=p["table"], softmax_scale=p["scale"], causal=p["causal"],
            window_size=p["window"], scheduler_metadata=p["meta"], num_splits=p["splits"], **extra)
        return out.reshape(n, self.num_qo_heads, self.head_dim)


class FA3PrefillWrapper(FA3PagedWrapper):
    """Paged prefill: rows of any number of queries (``qo_indptr``), packed."""

    kind = "prefill"
    capability = PAGED_PREFILL

    def plan(
        self,
        qo_indptr: PagedPlan | torch.Tensor,
        paged_kv_indptr: torch.Tensor | None = None,
        paged_kv_indices: torch.Tensor | None = None,
        paged_kv_last_page_len: torch.Tensor | None = None,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: torch.Tensor | None = None,
        window_left: int = -1,
        **kwargs: Any,
    ) -> None:
        """Contract 2.0: ``plan(PagedPlan)`` of this wrapper's capability, built and checked by the
        core; the loose form builds that plan with the core's ``paged_plan``."""
        who = f"{type(self).__name__}.plan"
        plan = given_plan(qo_indptr, paged_kv_indptr is not None or bool(kwargs), self.capability, who)
        if plan is None:
            plan = self._loose(who, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, causal,
                               dtype, kv_lens, window_left, kwargs)
        self._plan(plan, who)

    def _static_q_rows(self) -> int:
        if self.max_total_tokens is None:
            raise InputError(f"{type(self).__name__} with accelerator_graph=True needs max_total_tokens")
        return self.max_total_tokens

    def _static_buffers(self) -> dict[str, torch.Tensor]:
        self._static_q_rows()  # refused now, not at the first run
        return super()._static_buffers()


class FA3DecodeWrapper(FA3PagedWrapper):
    """Paged decode: every row ``query_tokens`` queries (1, or 2..8 for multi-token decode, causal),
    as ``q [rows * t, Hq, D]``, given to the kernel as ``[rows, t, Hq, D]``."""

    kind = "decode"
    capability = PAGED_DECODE

    def __init__(
        self,
        workspace_buffer: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int | None = None,
        max_num_pages: int | None = None,
        device: torch.device | str = "cuda",
        accelerator_graph: bool = False,
        enable_nvtx: bool = False,
        backend: str = "auto",
        query_tokens: int = 1,
    ) -> None:
        if not is_int(query_tokens) or query_tokens < 1:
            raise InputError(f"{type(self).__name__}: query_tokens must be an int >= 1, got {query_tokens!r}")
        self._init(self._loose_size(num_qo_heads, num_kv_heads, head_dim, page_size, batch_size, None, max_num_pages,
                                    device, accelerator_graph, query_tokens))

    def _init(self, size: WrapperSize) -> None:
        super()._init(size)
        self.max_total_tokens = None  # one row's queries are query_tokens
        self.query_tokens = size.query_tokens  # graph mode: the bucket's rows have this many each
        self._t = self.query_tokens

    def plan(  # the decode protocol's plan: no qo_indptr, no causal
        self,
        paged_kv_indptr: PagedPlan | torch.Tensor,
        paged_kv_indices: torch.Tensor | None = None,
        paged_kv_last_page_len: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        kv_lens: torch.Tensor | None = None,
        window_left: int = -1,
        query_tokens: int = 1,
        **kwargs: Any,
    ) -> None:
        """Contract 2.0: ``plan(PagedPlan)``, a paged_decode plan built and checked by the core
        (``query_tokens`` per row); the loose form builds that plan with the core's ``paged_plan``."""
        who = f"{type(self).__name__}.plan"
        plan = given_plan(paged_kv_indptr, paged_kv_indices is not None or bool(kwargs), PAGED_DECODE, who)
        if plan is None:
            plan = self._loose(who, None, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, True, dtype,
                               kv_lens, window_left, kwargs, query_tokens)
        t = plan.query_tokens
        if self.accelerator_graph and t != self.query_tokens:
            raise InputError(f"{who}: this graph-mode wrapper was built for {self.query_tokens} query tokens per row, "
                             f"planned with {t}")
        self._plan(plan, who)
        self._t = t  # only once planned: a refused plan keeps the previous one's

    def _static_q_rows(self) -> int:
        assert self.batch_size is not None
        return self.batch_size * self.query_tokens

    def _q_view(self, q: torch.Tensor, rows: int) -> torch.Tensor:
        return q.view(rows, self._t, self.num_qo_heads, self.head_dim)

    def run(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, *, k_scale: float | None = None,
            v_scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        p = self._planned
        if p is not None and self._static is None and q.shape[0] == p["tokens"] and p["rows"] == 0:
            return q.new_zeros(q.shape)  # no rows: nothing to attend
        return super().run(q, kv_cache_layer, k_scale=k_scale, v_scale=v_scale, sinks=sinks)


class FA3MixedWrapper(FA3PrefillWrapper):
    """One-token rows and prompt rows in one step: one varlen call (``cu_seqlens_q`` tells each
    row's queries), so no split into two plans is needed. Runs eagerly."""

    kind = "mixed"
    capability = MIXED
    graph_capturable = False
    max_prefill_rows: int | None = None

    def __init__(
        self,
        decode_workspace: torch.Tensor | None,
        prefill_workspace: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        batch_size: int,
        max_total_tokens: int,
        max_num_pages: int,
        max_prefill_rows: int,
        device: torch.device | str,
        backend: str = "auto",
    ) -> None:
        super().__init__(prefill_workspace, num_qo_heads, num_kv_heads, head_dim, page_size, batch_size,
                         max_total_tokens, max_num_pages, device)
        self.max_prefill_rows = max_prefill_rows

    def _init(self, size: WrapperSize) -> None:
        super()._init(dataclasses.replace(size, accelerator_graph=False))  # eager: its shapes change every step
        self.max_prefill_rows = size.max_prefill_rows
