"""Build-time checks: what FlashInfer 0.5.3 can run, refused with an error naming what it can.

Only CUDA runs FlashInfer; on any other device (CPU tests through a stand-in module) the dtype and
head-dim checks are skipped so the wrappers can be driven in float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mstar_core.plugin import InputError, InputTypeError, check_same_device, check_window_and_scale
from mstar_flashinfer.head_dim import check_flashinfer_head_dim
from mstar_flashinfer.staging import host_i32

__all__ = ["check_same_device", "check_window_and_scale"]  # re-exported for the wrappers

# The attention kernels take 16-bit queries and K/V (prefill.cuh: static_assert sizeof == 2).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    if is_cuda(device) and dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise InputError(f"FlashInfer cannot compute in {dtype}: its attention kernels take {names}")


def check_page_size(page_size: int) -> None:
    # Any positive page size is a kernel parameter, not a compiled variant; zero or a float is a bug.
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise InputError(f"page_size must be a positive int (FlashInfer takes any page size >= 1), got {page_size!r}")


def check_geometry(num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
    if head_dim < 1:
        raise InputError(f"head_dim must be >= 1, got {head_dim}")
    if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
        raise InputError(
            f"num_qo_heads ({num_qo_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    check_flashinfer_head_dim(head_dim, device)


def require(name: str, value: int | None, why: str) -> int:
    """A constructor argument that graph mode needs: static buffers are sized from it."""
    if value is None or value < 1:
        raise InputError(f"{name} is required {why} (static buffers are sized from it), got {value!r}")
    return int(value)


# -- plan-time index arrays ---------------------------------------------------------------------
# Checked on the host arrays before anything is staged, so a refused plan changes nothing: a few
# vectorised numpy ops per array (no loop over rows, no device sync for host inputs).

_INT32 = np.iinfo(np.int32)


def host_index(name: str, value: Any, who: str) -> np.ndarray:
    """``value`` as a 1-D int32 host array, refusing floats, bools, other ranks and values outside
    int32 (which a cast would wrap into plausible-looking indices)."""
    if type(value) is torch.Tensor and value.dtype is torch.int32 and value.dim() == 1 and value.is_cpu:
        return value.numpy()  # the common case, what the KV manager passes: no copy, no other check
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise InputTypeError(f"{who}: {name} must hold integers (int32), got dtype {value.dtype}")
        if value.dim() != 1:
            raise InputError(f"{who}: {name} must be 1-D, got shape {tuple(value.shape)}")
        if value.dtype == torch.int32:
            return host_i32(value)
        arr = value.cpu().numpy()
    else:
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise InputError(f"{who}: {name} must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            return np.zeros(0, dtype=np.int32)
        if arr.dtype.kind not in "iu":
            raise InputTypeError(f"{who}: {name} must hold integers (int32), got dtype {arr.dtype}")
        if arr.dtype == np.int32:
            return arr
    if arr.size and (int(arr.min()) < _INT32.min or int(arr.max()) > _INT32.max):
        bad = int(arr.max()) if int(arr.max()) > _INT32.max else int(arr.min())
        raise InputError(f"{who}: {name} holds {bad}, outside int32")
    return arr.astype(np.int32)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_indptr(name: str, indptr: np.ndarray, who: str, rows: int | None = None) -> np.ndarray:
    """At least one entry, starting at 0, non-decreasing; ``rows + 1`` entries when given.
    Returns the row lengths (``np.diff``)."""
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


def device_indices(value: torch.Tensor, device: torch.device, who: str) -> torch.Tensor:
    """Page indices already on the wrapper's device (the KV manager gathers them there): the
    dtype, rank and device are checked; the values are not, since reading them would wait for
    the device. A plan from them reads whatever pages they name."""
    if value.dtype != torch.int32:
        raise InputTypeError(f"{who}: kv_indices on {value.device} must be int32, got {value.dtype}")
    if value.dim() != 1:
        raise InputError(f"{who}: kv_indices must be 1-D, got shape {tuple(value.shape)}")
    check_same_device(who, device, kv_indices=value)
    return value


def check_paged_plan(
    who: str,
    indptr: np.ndarray,
    indices: np.ndarray | torch.Tensor,
    last: np.ndarray,
    page_size: int,
    *,
    qo: np.ndarray | None = None,
    kv_lens: np.ndarray | None = None,
    max_num_pages: int | None = None,
) -> int:
    """Refuse a paged plan a kernel would read out of bounds with (or compute garbage from), naming
    the first bad entry and what is allowed. Returns the largest page index (-1 for none), which
    ``run`` compares with the cache it is given.

    ``kv_indptr``: 1-D, from 0, non-decreasing, ``kv_indptr[-1] <= len(kv_indices)``;
    ``last_page_len``: one per row, in 1..page_size for a row with pages and 0 for a row without
    (what the KV manager plans; FlashInfer would count a non-zero one as keys on a page the row
    does not have); ``kv_indices`` >= 0, and < ``max_num_pages`` where given; ``qo_indptr``
    (prefill, mixed): rows + 1 entries from 0, non-decreasing, no row with more queries than
    keys; ``kv_lens``, when given, what the pages and last_page_len say.

    ``kv_indices`` may be a device tensor (:func:`device_indices`): its length is checked, not its
    values, and the largest page index returned is -1 (unknown).

    About a dozen vectorised numpy ops in all; the error paths alone look for the first bad row."""
    n_pages = check_indptr("kv_indptr", indptr, who)
    rows = n_pages.shape[0]
    used = int(indptr[-1])
    if used > indices.shape[0]:
        raise InputError(f"{who}: kv_indptr[-1] = {used} exceeds len(kv_indices) = {indices.shape[0]}; "
                         "the rows would read page indices past the end of kv_indices")
    if last.shape[0] != rows:
        raise InputError(f"{who}: last_page_len has {last.shape[0]} entries, "
                         f"expected {rows} (one per row of kv_indptr)")
    has = n_pages > 0
    # in 0..page_size (a negative one, seen as uint32, is above it), and 0 exactly where no pages
    if np.count_nonzero(last.view(np.uint32) > page_size) or np.count_nonzero((last > 0) != has):
        i = _first(np.where(has, (last < 1) | (last > page_size), last != 0))
        allowed = f"1..{page_size} (page_size)" if has[i] else "0 (the row has no pages)"
        raise InputError(f"{who}: last_page_len[{i}] = {int(last[i])} for a row with {int(n_pages[i])} pages; "
                         f"allowed: {allowed}")
    top = -1
    if isinstance(indices, np.ndarray) and indices.shape[0]:
        top = int(indices.view(np.uint32).max())  # a negative index, seen as uint32, is the largest
        if top > _INT32.max:
            i = _first(indices < 0)
            raise InputError(f"{who}: kv_indices[{i}] = {int(indices[i])} is negative; page indices must be >= 0")
        if max_num_pages is not None:
            check_page_range(who, indices, top, max_num_pages)
    if kv_lens is None and qo is None:
        return top
    # a row's keys: full pages but the last, plus last_page_len (0 for a row without pages)
    lens = (n_pages - has) * page_size + last
    if kv_lens is not None:
        if kv_lens.shape[0] != rows:
            raise InputError(f"{who}: kv_lens has {kv_lens.shape[0]} entries, expected {rows} (one per row)")
        off = kv_lens != lens
        if np.count_nonzero(off):
            i = _first(off)
            raise InputError(f"{who}: kv_lens[{i}] = {int(kv_lens[i])} disagrees with the row's pages "
                             f"({int(n_pages[i])} pages, last_page_len {int(last[i])}: {int(lens[i])} tokens)")
    if qo is not None:
        check_keys_cover_queries(who, check_indptr("qo_indptr", qo, who, rows), lens, True, "row")
    return top


def check_keys_cover_queries(who: str, q_lens: np.ndarray, k_lens: np.ndarray, causal: bool, unit: str) -> None:
    """Every row (``unit``: "row" or "segment") holds at least as many keys as queries (causal),
    or some key (not causal): a row's queries are its last keys, and FlashInfer leaves a query
    that sees no key undefined (0.5.3's sm90 kernel returns the mean of the loaded values) where
    the contract asks for zeros, so such a plan is refused."""
    short = (q_lens > k_lens) if causal else ((q_lens > 0) & (k_lens == 0))
    if np.count_nonzero(short):
        i = _first(short)
        raise InputError(f"{who}: {unit} {i} has {int(q_lens[i])} queries but {int(k_lens[i])} keys; a {unit}'s "
                         "queries are its last keys and FlashInfer leaves a query that sees no key undefined, so a "
                         f"{unit} needs at least as many keys as queries")


def check_page_range(who: str, indices: np.ndarray, top: int, max_num_pages: int) -> None:
    """Page indices below ``max_num_pages`` (``top``: their maximum, from :func:`check_paged_plan`)."""
    if top >= max_num_pages:
        i = _first(indices >= max_num_pages)
        raise InputError(f"{who}: kv_indices[{i}] = {int(indices[i])} is out of range; page indices must be "
                         f"< max_num_pages={max_num_pages}")
