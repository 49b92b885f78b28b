"""FlashInfer's first-use compiles, announced (``mstar_core.plugin.first_use``): FlashInfer builds each kernel
family -- q/KV dtype, head dim, sliding window or not, soft-cap or not, fa2 or fa3 -- with nvcc the
first time a plan needs it, unless a compiled copy is in its cache (``~/.cache/flashinfer``), in the
package's ``data/aot`` folder or in flashinfer-jit-cache. Which modules a call built is read from
FlashInfer's JIT folder (``flashinfer.jit.env.FLASHINFER_JIT_DIR``) before and after it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mstar_core.plugin import dtype_name, first_use, first_use_seen

log = logging.getLogger("mstar.flashinfer")

WHY = ("FlashInfer compiles each kernel family (dtype, head dim, variant) with nvcc on its first use on a machine, "
       "20-120 s on an H200, unless a compiled copy is cached (~/.cache/flashinfer) or prebuilt "
       "(flashinfer-jit-cache); `mstar warmup` does this ahead of serving")

# FlashInfer 0.7.4 picks fa2 for a paged prefill plan whose longest query is at most this long and
# fa3 otherwise (on Hopper): a different module, so a different first use.
SHORT_QUERY = 64


def jit_dir() -> Path | None:
    """FlashInfer's folder of JIT-built modules, or None where this build has none to read."""
    try:
        from flashinfer.jit import env
    except ImportError:
        return None
    d = getattr(env, "FLASHINFER_JIT_DIR", None)
    return Path(d) if d is not None else None


def built_modules(d: Path | None) -> set[str]:
    """Names of the modules compiled into ``d`` so far (``<name>/<name>.so``)."""
    if d is None or not d.is_dir():
        return set()
    return {p.parent.name for p in d.glob("*/*.so") if p.stem == p.parent.name}


def built_since(d: Path | None) -> Callable[[], set[str]]:
    """Snapshot ``d`` now; the returned function gives the modules compiled into it since."""
    before = built_modules(d)
    return lambda: built_modules(d) - before


def describe(new: set[str]) -> str:
    if not new:
        return "nothing compiled: already built (FlashInfer's cache, a prebuilt package, or this process)"
    return f"compiled {len(new)} module{'s' if len(new) > 1 else ''}: {', '.join(sorted(new))}"


_SEEN = contextlib.nullcontext()  # reusable: what a plan gets once its selection was seen


def plan_first_use(
    kind: str, dtype: torch.dtype, kv_dtype: torch.dtype | None, head_dim: int, window_left: int,
    soft_cap: float | None, backend: str, qo: np.ndarray | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Around FlashInfer's ``plan`` (where it builds or loads the module): a no-op (a set lookup or
    two) once the selection has been seen in this process. ``qo`` (a prefill plan's host qo_indptr)
    splits it further by the longest query (0.7.4: fa2 up to SHORT_QUERY tokens, fa3 beyond); the
    query lengths are read only while one of the two has not been seen."""
    base = ("flashinfer", kind, dtype, kv_dtype or dtype, head_dim, window_left >= 0, bool(soft_cap), backend)
    if qo is None:
        key = base + (False,)
    elif first_use_seen(base + (False,)) and first_use_seen(base + (True,)):
        return _SEEN
    else:
        key = base + (long_queries(qo),)
    if first_use_seen(key):
        return _SEEN
    kv = kv_dtype or dtype
    parts = [dtype_name(dtype) + ("" if kv == dtype else f" q, {dtype_name(kv)} KV"), f"head_dim {head_dim}"]
    if window_left >= 0:
        parts.append("sliding window")
    if soft_cap:
        parts.append("soft-cap")
    if qo is not None:
        parts.append(f"queries {'over' if key[-1] else 'up to'} {SHORT_QUERY} tokens")
    if backend != "auto":
        parts.append(f"backend {backend}")
    new = built_since(jit_dir())
    return first_use(key, f"FlashInfer {kind} kernels ({', '.join(parts)})", WHY, log,
                               lambda: describe(new()))


def long_queries(qo: np.ndarray) -> bool:
    """Is the longest row of a host ``qo_indptr`` longer than SHORT_QUERY?"""
    return qo.shape[0] > 1 and int((qo[1:] - qo[:-1]).max()) > SHORT_QUERY
