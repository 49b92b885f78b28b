"""Bounded attention: attention over a slot's retained keys (sink + ring), an optional prefix, and
the step's own keys; plus the write of the step's keys into the slot.

What a query sees. A request's step covers stream positions ``start .. start + n - 1``
(``start`` = tokens committed before the step). Its query at position ``p`` sees:

- its **prefix** (``source[s]`` or a ``row_source`` entry), if the request has one: every key of
  it, no stream position, no ``rel_bias``;
- the **sink**: positions ``0 .. min(start, sink) - 1``, always (also under a query window);
- the **ring**: the last ``window`` positions before the step, ``max(sink, start - window) ..
  start - 1`` — without a query window, all of them;
- its **own step**, causally: positions ``start .. p``.

With a per-query window ``query_window = w`` (``w <= window``) the ring and own-step keys are
further limited to ``p - w .. p``; sinks stay visible. Since ``w <= window`` everything such a
query may see is still retained, so the result does not depend on how the stream was split into
steps: it is sliding-window attention with sinks. Without a query window a query sees the whole
ring plus its step's keys so far, so a long step's last query sees up to ``window + n`` stream
keys.

Positions. Retained keys keep the stream positions they were written at (a key is stored as
given: rotary embeddings, if any, were applied by the caller at that position). Cache index
``j < sink`` holds position ``j``; ring index ``j >= sink`` holds position ``p`` with
``sink + (p - sink) % window == j``, the latest one before the step.

``rel_bias`` ``[B * rows, Hq, T, NB]`` adds ``rel_bias[.., t, min(d, NB - 1)]`` (natural-log
units, after ``sm_scale``) to the score of query ``t`` against a stream key at distance
``d = p_query - p_key >= 0``; prefix keys get none. With a query window ``NB = window + 1``:
one entry per distance the ring spans, so a sink within ``window`` of the query gets
its own distance's entry and only farther sinks take the last one; without a query window ``NB``
is the caller's choice and farther keys take the last entry.

Spans longer than the window. All of the step's keys are attended (causally, within the query
window if any); then only positions below ``sink`` and the last ``window`` of the rest are
written, the earlier ones being exactly those the ring would overwrite within the step.

Heads. ``q`` has ``Hq`` heads, ``k``/``v`` and the cache ``H``; ``Hq`` must be a multiple of
``H`` and query head ``h`` reads KV head ``h // (Hq // H)`` (grouped-query attention).

``ieee=True``: no TF32 (exact fp32 products for fp32 inputs) and only fixed-order reductions, so
repeated calls give identical bits. The Triton kernel never uses atomics; the reference runs
TF32 off.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

from mstar_core.errors import InputError
from mstar_core.kernels.bounded_attention import table as tb
from mstar_core.kernels.bounded_attention.reference import bounded_attention_reference, write_step_reference

Impl = Literal["auto", "reference", "triton"]

__all__ = ["Impl", "bounded_attention", "bounded_write", "pick_impl", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def pick_impl(device: torch.device, impl: Impl = "auto") -> Literal["reference", "triton"]:
    """``auto``: Triton on CUDA when triton is importable, else the reference.
    ``MSTAR_BOUNDED_IMPL=reference|triton`` overrides ``auto``."""
    choice: str = impl  # the environment's value is any string until checked below
    if choice == "auto":
        choice = os.environ.get("MSTAR_BOUNDED_IMPL", "auto")
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if choice == "triton":
        if device.type != "cuda":
            raise InputError(f"bounded_attention impl='triton' needs a CUDA tensor, got device {device}")
        if not triton_available():
            raise ImportError("bounded_attention impl='triton': triton is not installed")
        return "triton"
    if choice == "reference":
        return "reference"
    raise InputError(f"bounded_attention impl must be 'auto', 'reference' or 'triton', got {choice!r}")


def _check(q, k, v, cache, tab, sink, window, query_window, source, row_source, rel_bias) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise InputError(f"q, k, v must be [B * rows, H, T, D] with k.shape == v.shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    BR, Hq, T, D = q.shape
    if k.shape[0] != BR or k.shape[2] != T or k.shape[3] != D or Hq % k.shape[1]:
        raise InputError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)}: expected "
                         f"[{BR}, H, {T}, {D}] with {Hq} a multiple of H")
    B = tab.shape[0]
    if tab.dim() != 2 or tab.shape[1] != tb.NUM_COLS or B == 0 or BR % B:
        raise InputError(f"table must be [B, {tb.NUM_COLS}] with B dividing {BR}; got {tuple(tab.shape)}")
    rows, H = BR // B, k.shape[1]
    if cache.dim() != 5 or cache.shape[1] != rows or cache.shape[2] != H or cache.shape[4] != 2 * D:
        raise InputError(f"cache must be [slots, {rows}, {H}, cap, {2 * D}], got {tuple(cache.shape)}")
    if cache.shape[3] != sink + window:
        raise InputError(f"cache holds {cache.shape[3]} keys a row, expected sink + window = {sink + window}")
    if window < 1 or sink < 0:
        raise InputError(f"need window >= 1 and sink >= 0, got window={window}, sink={sink}")
    if query_window is not None and not 0 <= query_window <= window:
        raise InputError(f"query_window must be in [0, window={window}], got {query_window}")
    for name, s in (("source", source), ("row_source storage", row_source[0] if row_source else None)):
        if s is not None and (s.dim() != 5 or s.shape[1:3] != (rows, H) or s.shape[4] != 2 * D):
            raise InputError(f"{name} must be [n, {rows}, {H}, L, {2 * D}], got {tuple(s.shape)}")
    if row_source is not None and row_source[1].shape[0] < B:
        raise InputError(f"row_source slots must hold >= {B} entries, got {tuple(row_source[1].shape)}")
    if rel_bias is not None:
        if rel_bias.dim() != 4 or rel_bias.shape[:3] != (BR, Hq, T):
            raise InputError(f"rel_bias must be [{BR}, {Hq}, {T}, NB], got {tuple(rel_bias.shape)}")
        if query_window is not None and rel_bias.shape[3] != window + 1:
            raise InputError(f"with a query window (query_window={query_window}), rel_bias is indexed by "
                             f"distance 0..window={window}: last dim {window + 1}, got {rel_bias.shape[3]}")


def bounded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    *,
    sink: int,
    window: int,
    query_window: int | None = None,
    source: torch.Tensor | None = None,
    row_source: tuple[torch.Tensor, torch.Tensor] | None = None,
    rel_bias: torch.Tensor | None = None,
    sm_scale: float | None = None,
    ieee: bool = False,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Attention of ``q`` ``[B * rows, Hq, T, D]`` over each request row's keys (see the module
    docstring for which), returning ``[B * rows, T, Hq, D]`` in ``q``'s dtype.

    ``k``/``v`` ``[B * rows, H, T, D]`` are the step's own keys; ``cache`` is one layer's slots
    ``[slots, rows, H, sink + window, 2D]`` (K then V in the last dim); ``table`` the
    ``[B, NUM_COLS]`` int table of :mod:`.table`; ``source`` ``[n, rows, H, L, 2D]`` prefixes
    picked by the table's SOURCE; ``row_source = (storage [slots', rows, H, L', 2D], slots
    [>= B])`` the prefix of requests whose SOURCE is -1. Does not write the cache: see
    :func:`bounded_write`. ``impl`` forces ``"reference"`` or ``"triton"``."""
    _check(q, k, v, cache, table, sink, window, query_window, source, row_source, rel_bias)
    attend = bounded_attention_reference
    if pick_impl(q.device, impl) == "triton":
        from mstar_core.kernels.bounded_attention.triton_kernel import bounded_attention_triton

        attend = bounded_attention_triton
    return attend(q, k, v, cache, table, sink=sink, window=window, query_window=query_window, source=source,
                  row_source=row_source, rel_bias=rel_bias, sm_scale=sm_scale, ieee=ieee)


def bounded_write(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, *,
    sink: int, window: int, impl: Impl = "auto",
) -> None:
    """Write the step's keys into their slots (rows whose WRITE is 1): positions below ``sink``
    into the sink region, the last ``window`` of the rest into the ring."""
    if pick_impl(k.device, impl) == "triton":
        from mstar_core.kernels.bounded_attention.triton_kernel import write_step_triton

        write_step_triton(cache, k, v, table, sink=sink, window=window)
    else:
        write_step_reference(cache, k, v, table, sink=sink, window=window)
