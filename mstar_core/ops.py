"""mstar's per-layer calls as torch custom ops, so ``torch.compile`` traces a model around them.

A compiled graph cannot read the Python state a layer's call depends on (which step is bound,
its plans), so under ``torch.compile`` the managers' ``write_kv``, ``run`` and ``attend`` become
these ops: they take tensors and plain values only (the manager by its integer ``handle``, the
layer, the label), and the plan is looked up when the op runs, outside the traced graph. One
compiled graph therefore serves every step of a bucket. Each op declares the cache it writes
(``mutates_args``); each writes into and reads from the tensors it is given (a compiler that
copies a mutated input hands the op the copy), and says once when that copy happened, because it
costs a copy of the cache per layer.

Outside a compile the managers call their own eager paths directly: an op call costs a dispatch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import Any

import torch

from mstar_core.errors import StateError

log = logging.getLogger(__name__)

_objects: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_numbers = itertools.count(1)
_lock = threading.Lock()
_copied: set[int] = set()  # handles whose cache a compiled graph handed over as a copy (said once)


def register(obj: Any) -> int:
    """A process-wide number for ``obj`` (held weakly): what a compiled graph passes to an op."""
    with _lock:
        n = next(_numbers)
        _objects[n] = obj
    return n


def resolve(handle: int) -> Any:
    obj = _objects.get(handle)
    if obj is None:
        raise StateError(f"mstar op: resource #{handle} no longer exists (a compiled graph outlived the engine or "
                         "node it was traced for); compile again for the new one")
    return obj


def note_copy(handle: int, given: torch.Tensor, own: torch.Tensor, who: str) -> None:
    """Say once per resource that a compiled graph passed a copy of its cache, not the cache."""
    if given.data_ptr() != own.data_ptr() and handle not in _copied:
        _copied.add(handle)
        log.warning("%s: the compiled graph passes a copy of the cache to mstar's op (the compiler did not write it "
                    "in place: torch.compile with backend 'inductor' does); results are right, but every layer "
                    "copies the cache", who)


@torch.library.custom_op("mstar::write_kv", mutates_args=("storage",))
def write_kv(k: torch.Tensor, v: torch.Tensor, storage: torch.Tensor, handle: int, layer_idx: int,
             label: str) -> None:
    """``KVManager.write_kv`` into ``storage`` (the manager's cache, ``[layers, pages, 2, ...]``)."""
    kv = resolve(handle)
    note_copy(handle, storage, kv.storage, kv.name)
    kv.write_kv_into(storage, k, v, layer_idx, label or None)


@write_kv.register_fake
def _(k: torch.Tensor, v: torch.Tensor, storage: torch.Tensor, handle: int, layer_idx: int, label: str) -> None:
    return None


@torch.library.custom_op("mstar::paged_run", mutates_args=())
def paged_run(q: torch.Tensor, kv_cache_layer: torch.Tensor, handle: int, layer_idx: int, label: str,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """``PagedAttentionManager.run``: ``q [tokens, Hq, D]`` over ``kv_cache_layer`` -> ``[tokens, Hq, D]``."""
    out = resolve(handle).run_eager(q, label or None, kv_cache_layer, layer_idx, sinks, check_view=False)
    return out.contiguous()


@paged_run.register_fake
def _(q: torch.Tensor, kv_cache_layer: torch.Tensor, handle: int, layer_idx: int, label: str,
      sinks: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("mstar::dense_run", mutates_args=("storage",))
def dense_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, storage: torch.Tensor, handle: int,
              layer_idx: int, label: str, sinks: torch.Tensor | None) -> torch.Tensor:
    """``DenseAttentionManager.run``: writes the committed K/V into ``storage`` (the paged cache) and
    attends over prefix + fresh K/V -> ``[tokens, Hq, D]``."""
    attn = resolve(handle)
    note_copy(handle, storage, attn.kv.storage, type(attn).__name__)
    return attn.run_eager(q, label or None, storage, k, v, layer_idx, sinks).contiguous()


@dense_run.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, storage: torch.Tensor, handle: int, layer_idx: int,
      label: str, sinks: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("mstar::bounded_attend", mutates_args=("storage",))
def bounded_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, storage: torch.Tensor, handle: int,
                   layer_idx: int, source: torch.Tensor | None, rel_bias: torch.Tensor | None, ieee: bool,
                   row_source_storage: torch.Tensor | None, row_source_slots: torch.Tensor | None) -> torch.Tensor:
    """``BoundedKVManager.attend`` over ``storage`` (every layer's slots), writing the step's keys
    into it: ``q [B * rows, H, T, D]`` -> ``[B * rows, T, H, D]``."""
    row_source = None if row_source_storage is None or row_source_slots is None else (
        row_source_storage, row_source_slots)
    mgr = resolve(handle)
    note_copy(handle, storage, mgr.storage, mgr.name)
    return mgr.attend_eager(storage, layer_idx, q, k, v, source, None, rel_bias, ieee, row_source).contiguous()


@bounded_attend.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, storage: torch.Tensor, handle: int, layer_idx: int,
      source: torch.Tensor | None, rel_bias: torch.Tensor | None, ieee: bool,
      row_source_storage: torch.Tensor | None, row_source_slots: torch.Tensor | None) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))
