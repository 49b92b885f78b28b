"""The plan objects of plugin contract 2.0: what the core hands a wrapper. The managers (and
``mstar check``) build one per step, label and kind, checked once here (a dozen vectorised ops on
the host arrays, no device sync), before any wrapper sees it; a 2.0 wrapper reads its fields and
checks nothing again. ``WrapperSize`` is what a 2.0 wrapper is built for.

A plan holds its arrays as given (no copy): do not change them in place while a wrapper planned
with it may still run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from mstar_core.attention.checks import FP8_DTYPES, check_soft_cap
from mstar_core.capabilities import PAGED, PAGED_DECODE
from mstar_core.errors import InputError, InputTypeError
from mstar_core.step import check_window_and_scale, is_int

_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class WrapperSize:
    """What one wrapper is built for. Paged wrappers read ``page_size`` and, in graph mode
    (``accelerator_graph``), the static maxima: ``batch_size`` rows, ``max_total_tokens`` query
    tokens (prefill), ``max_num_pages`` pages, ``query_tokens`` per decode row. A mixed wrapper
    reads ``batch_size``, ``max_total_tokens``, ``max_num_pages`` and ``max_prefill_rows`` in every
    mode. ``options`` carries a backend's own settings (FlashInfer's ``backend``), untouched."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    page_size: int = 0  # 0: not a paged wrapper
    batch_size: int | None = None
    max_total_tokens: int | None = None
    max_num_pages: int | None = None
    max_prefill_rows: int | None = None
    accelerator_graph: bool = False
    query_tokens: int = 1
    workspace_bytes: int = 128 << 20  # FlashInfer's recommendation per wrapper
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise InputError(f"WrapperSize: {name} must be a positive int, got {v!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise InputError(f"WrapperSize: num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if not is_int(self.page_size) or self.page_size < 0:
            raise InputError(f"WrapperSize: page_size must be an int >= 1 (0 for a ragged wrapper), "
                             f"got {self.page_size!r}")
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "options", dict(self.options))

    def workspace(self) -> torch.Tensor:
        """A fresh workspace of ``workspace_bytes`` on the device."""
        return torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)


@dataclass(frozen=True, eq=False)
class PagedPlan:
    """One paged plan (``kind``: paged_prefill, paged_decode or mixed), as :func:`paged_plan`
    builds and checks it. Index arrays are int32; every one but ``kv_indices`` is on the host.
    ``kv_indices`` is on the cache's device or the host; ``kv_indices_host``, where the builder
    had it, is the same on the host. Decode plans carry ``qo_indptr`` too (``query_tokens`` per
    row). The derived fields (``rows`` ... ``max_page``) are computed once here, for every
    wrapper that reads the plan."""

    kind: str
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    page_size: int
    dtype: torch.dtype
    causal: bool = True
    window_left: int = -1
    sm_scale: float | None = None
    logits_soft_cap: float | None = None
    kv_data_type: torch.dtype | None = None
    sink_logits: bool = False
    query_tokens: int = 1
    kv_indices_host: torch.Tensor | None = None
    rows: int = 0
    tokens: int = 0
    max_q: int = 0
    max_kv: int = 0
    # the largest page index a row reads; -1 where the indices are on a device (not read)
    max_page: int = -1
    # every row holds at least as many keys as queries (so no query sees no key)
    keys_cover_queries: bool = True

    @property
    def q_lens(self) -> np.ndarray:
        q = self.qo_indptr.numpy()
        return q[1:] - q[:-1]

    def variant(self, window_left: int, sink_logits: bool) -> PagedPlan:
        """The same rows under another window or sink-logit setting (per-layer plans); the arrays
        are shared and not checked again."""
        if window_left == self.window_left and sink_logits == self.sink_logits:
            return self
        check_window_and_scale(f"{self.kind} plan", window_left, None)
        return replace(self, window_left=window_left, sink_logits=bool(sink_logits))


@dataclass(frozen=True, eq=False)
class RaggedPlan:
    """One prefixed ragged plan (the dense path): segment i's queries are ``q[cu_q[i]:cu_q[i+1]]``
    and its keys ``k[cu_k[i]:cu_k[i+1]]``; ``cu_q``/``cu_k`` int32 on the host."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    dtype: torch.dtype
    causal: bool = True
    window_left: int = -1
    sm_scale: float | None = None
    logits_soft_cap: float | None = None
    sink_logits: bool = False
    rows: int = 0
    tokens: int = 0
    keys_cover_queries: bool = True


def _host_index(name: str, value: Any, who: str) -> torch.Tensor:
    """``value`` as a 1-D int32 host tensor, refusing floats, bools, other ranks and values outside
    int32 (which a cast would wrap into plausible-looking indices)."""
    if type(value) is torch.Tensor and value.dtype is torch.int32 and value.dim() == 1 and value.is_cpu:
        return value  # what the KV manager passes: no copy, no other check
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (list, tuple)) and not value:
            return torch.zeros(0, dtype=torch.int32)  # numpy reads an empty list as float64
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError) as e:
            raise InputTypeError(f"{who}: {name} must be a 1-D int32 tensor, got {type(value).__name__}") from e
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise InputTypeError(f"{who}: {name} must hold integers (int32), got dtype {value.dtype}")
    if value.dim() != 1:
        raise InputError(f"{who}: {name} must be 1-D, got shape {tuple(value.shape)}")
    value = value.cpu()
    if value.dtype != torch.int32 and value.numel():
        lo, hi = int(value.min()), int(value.max())
        if lo < _INT32.min or hi > _INT32.max:
            raise InputError(f"{who}: {name} holds {hi if hi > _INT32.max else lo}, outside int32")
    return value.to(torch.int32)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _lengths(name: str, indptr: np.ndarray, who: str, rows: int | None = None) -> np.ndarray:
    """An indptr's row lengths: at least one entry, from 0, non-decreasing, ``rows + 1`` entries
    where given."""
    if indptr.shape[0] < 1:
        raise InputError(f"{who}: {name} must have at least one entry ([0] for no rows), got an empty array")
    if rows is not None and indptr.shape[0] != rows + 1:
        raise InputError(f"{who}: {name} has {indptr.shape[0]} entries, expected {rows + 1} (rows + 1)")
    if indptr[0] != 0:
        raise InputError(f"{who}: {name} must start at 0, got {name}[0] = {int(indptr[0])}")
    lengths = indptr[1:] - indptr[:-1]
    if np.count_nonzero(lengths < 0):
        i = _first(lengths < 0)
        raise InputError(f"{who}: {name} must be non-decreasing, got {name}[{i}] = {int(indptr[i])} > "
                         f"{name}[{i + 1}] = {int(indptr[i + 1])}")
    return lengths


def _check_dtype(name: str, value: Any, who: str) -> None:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InputTypeError(f"{who}: {name} must be a float torch.dtype, got {value!r}")


def check_sm_scale_and_cap(who: str, window_left: Any, sm_scale: Any, logits_soft_cap: Any) -> float | None:
    """The scalars every plan carries; returns the soft cap as a float (None: no cap)."""
    check_window_and_scale(who, window_left, sm_scale)
    return check_soft_cap(logits_soft_cap, who)


def paged_plan(
    kind: str,
    qo_indptr: Any,
    kv_indptr: Any,
    kv_indices: Any,
    kv_last_page_len: Any,
    page_size: int,
    dtype: torch.dtype,
    *,
    causal: bool = True,
    kv_lens: Any = None,
    window_left: int = -1,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    kv_data_type: torch.dtype | None = None,
    sink_logits: bool = False,
    query_tokens: int = 1,
    kv_indices_host: Any = None,
    who: str | None = None,
) -> PagedPlan:
    """Build and check one paged plan, refusing what a kernel would read out of bounds with (or
    compute garbage from), naming the first bad entry and what is allowed:

    ``kv_indptr`` 1-D from 0, non-decreasing, ``kv_indptr[-1] <= len(kv_indices)``;
    ``kv_last_page_len`` one per row, in 1..page_size for a row with pages and 0 for one without;
    host ``kv_indices`` >= 0 (device ones: dtype and length only, reading them would synchronise);
    ``qo_indptr`` (None for decode: ``query_tokens`` per row) rows + 1 entries from 0,
    non-decreasing; ``kv_lens`` (None: from the pages) what the pages say. Rows with fewer keys
    than queries are allowed (the contract gives their keyless queries zeros): the plan says so in
    ``keys_cover_queries``, for a kernel that must refuse them."""
    who = who or f"{kind} plan"
    if kind not in PAGED:
        raise InputError(f"{who}: kind must be one of {list(PAGED)}, got {kind!r}")
    if not is_int(page_size) or page_size < 1:
        raise InputError(f"{who}: page_size must be a positive int, got {page_size!r}")
    _check_dtype("dtype", dtype, who)
    cap = check_sm_scale_and_cap(who, window_left, sm_scale, logits_soft_cap)
    if kv_data_type is not None:
        if not isinstance(kv_data_type, torch.dtype) or not kv_data_type.is_floating_point:
            raise InputError(f"{who}: kv_data_type must be a float torch.dtype (the query dtype, or "
                             f"{' / '.join(str(d) for d in FP8_DTYPES)} for an FP8 cache), got {kv_data_type!r}")
    if not isinstance(sink_logits, bool):
        raise InputTypeError(f"{who}: sink_logits must be a bool, got {sink_logits!r}")
    if not isinstance(causal, bool):
        raise InputTypeError(f"{who}: causal must be a bool, got {causal!r}")
    if not is_int(query_tokens) or query_tokens < 1 or (query_tokens > 1 and kind != PAGED_DECODE):
        raise InputError(f"{who}: query_tokens must be an int >= 1 (query tokens per row; above 1 in a "
                         f"{PAGED_DECODE} plan alone), got {query_tokens!r} in a {kind} plan")
    indptr_t = _host_index("kv_indptr", kv_indptr, who)
    last_t = _host_index("kv_last_page_len", kv_last_page_len, who)
    indptr = indptr_t.numpy()
    n_pages = _lengths("kv_indptr", indptr, who)
    rows = n_pages.shape[0]
    host_t: torch.Tensor | None
    if isinstance(kv_indices, torch.Tensor) and not kv_indices.is_cpu:
        if kv_indices.dtype != torch.int32:
            raise InputTypeError(f"{who}: kv_indices on {kv_indices.device} must be int32, got {kv_indices.dtype}")
        if kv_indices.dim() != 1:
            raise InputError(f"{who}: kv_indices must be 1-D, got shape {tuple(kv_indices.shape)}")
        indices_t = kv_indices
        host_t = None if kv_indices_host is None else _host_index("kv_indices_host", kv_indices_host, who)
    else:
        indices_t = host_t = _host_index("kv_indices", kv_indices, who)
    used = int(indptr[-1])
    if used > indices_t.shape[0]:
        raise InputError(f"{who}: kv_indptr[-1] = {used} exceeds len(kv_indices) = {indices_t.shape[0]}; "
                         "the rows would read page indices past the end of kv_indices")
    last = last_t.numpy()
    if last.shape[0] != rows:
        raise InputError(f"{who}: kv_last_page_len has {last.shape[0]} entries, expected {rows} (one per row of "
                         "kv_indptr)")
    has = n_pages > 0
    # in 0..page_size (a negative one, seen as uint32, is above it), and 0 exactly where no pages
    if np.count_nonzero(last.view(np.uint32) > page_size) or np.count_nonzero((last > 0) != has):
        i = _first(np.where(has, (last < 1) | (last > page_size), last != 0))
        allowed = f"1..{page_size} (page_size)" if has[i] else "0 (the row has no pages)"
        raise InputError(f"{who}: kv_last_page_len[{i}] = {int(last[i])} for a row with {int(n_pages[i])} pages; "
                         f"allowed: {allowed}")
    top = -1
    if host_t is not None and host_t.shape[0]:
        h = host_t.numpy()
        top = int(h[:used].view(np.uint32).max()) if used else -1  # a negative index, as uint32, is the largest
        if top > _INT32.max:
            i = _first(h[:used] < 0)
            raise InputError(f"{who}: kv_indices[{i}] = {int(h[i])} is negative; page indices must be >= 0")
    # a row's keys: full pages but the last, plus last_page_len (0 for a row without pages)
    lens = (n_pages - has) * page_size + last
    if kv_lens is None:
        lens_t = torch.from_numpy(lens.astype(np.int32))
    else:
        lens_t = _host_index("kv_lens", kv_lens, who)
        given = lens_t.numpy()
        if given.shape[0] != rows:
            raise InputError(f"{who}: kv_lens has {given.shape[0]} entries, expected {rows} (one per row)")
        off = given != lens
        if np.count_nonzero(off):
            i = _first(off)
            raise InputError(f"{who}: kv_lens[{i}] = {int(given[i])} disagrees with the row's pages "
                             f"({int(n_pages[i])} pages, kv_last_page_len {int(last[i])}: {int(lens[i])} tokens)")
    if qo_indptr is None:
        if kind != PAGED_DECODE:
            raise InputError(f"{who}: a {kind} plan needs qo_indptr")
        qo_t = torch.arange(0, (rows + 1) * query_tokens, query_tokens, dtype=torch.int32)
        q_lens = np.full(rows, query_tokens, dtype=np.int32)
    else:
        qo_t = _host_index("qo_indptr", qo_indptr, who)
        q_lens = _lengths("qo_indptr", qo_t.numpy(), who, rows)
    tokens = int(qo_t[-1])
    if kind == PAGED_DECODE and (tokens != rows * query_tokens or np.count_nonzero(q_lens != query_tokens)):
        raise InputError(f"{who}: a decode plan has {query_tokens} query tokens in every row; these rows have "
                         f"{sorted(set(q_lens.tolist()))}")
    cover = not np.count_nonzero((q_lens > lens) if causal else ((q_lens > 0) & (lens == 0)))
    return PagedPlan(
        kind, qo_t, indptr_t, indices_t, last_t, lens_t, page_size, dtype, causal, window_left,
        None if sm_scale is None else float(sm_scale), cap, kv_data_type, sink_logits, query_tokens,
        host_t, rows, tokens, int(q_lens.max()) if rows else 0, int(lens.max()) if rows else 0, top, cover)


def ragged_plan(
    cu_q: Any, cu_k: Any, max_q: int, max_k: int, dtype: torch.dtype, *, causal: bool = True,
    window_left: int = -1, sm_scale: float | None = None, logits_soft_cap: float | None = None,
    sink_logits: bool = False, who: str = "prefixed_ragged plan",
) -> RaggedPlan:
    """Build and check one prefixed ragged plan: ``cu_q``, ``cu_k`` int32 offsets from 0,
    non-decreasing, one entry more than segments each; ``max_q``/``max_k`` at least the longest
    segment's counts."""
    _check_dtype("dtype", dtype, who)
    cap = check_sm_scale_and_cap(who, window_left, sm_scale, logits_soft_cap)
    if not isinstance(causal, bool):
        raise InputTypeError(f"{who}: causal must be a bool, got {causal!r}")
    if not isinstance(sink_logits, bool):
        raise InputTypeError(f"{who}: sink_logits must be a bool, got {sink_logits!r}")
    q_t = _host_index("cu_q", cu_q, who)
    q_lens = _lengths("cu_q", q_t.numpy(), who)
    k_t = _host_index("cu_k", cu_k, who)
    k_lens = _lengths("cu_k", k_t.numpy(), who, q_lens.shape[0])
    for name, given, longest in (("max_q", max_q, q_lens), ("max_k", max_k, k_lens)):
        top = int(longest.max()) if longest.shape[0] else 0
        if not is_int(given) or given < top:
            raise InputError(f"{who}: {name} must be an int >= the longest segment's count ({top}), got {given!r}")
    cover = not np.count_nonzero((q_lens > k_lens) if causal else ((q_lens > 0) & (k_lens == 0)))
    return RaggedPlan(q_t, k_t, int(max_q), int(max_k), dtype, causal, window_left,
                      None if sm_scale is None else float(sm_scale), cap, sink_logits, int(q_lens.shape[0]),
                      int(q_t[-1]), cover)
