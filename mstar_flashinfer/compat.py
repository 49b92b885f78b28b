"""What differs between the FlashInfer releases this plugin supports, in one place.

Verified on the H200 (see ``results/versions.md``): 0.5.3, 0.7.2.post1 and 0.7.4. Each difference is
detected from the library itself (a constructor parameter, an attribute), not from the version
string, so a build between or after those releases takes whichever path it actually offers; the
version is only logged.

Three differences touch the wrappers:

* **The graph-mode token budget.** In CUDA-graph mode FlashInfer's paged prefill fixes how many
  query tokens a plan may hold at its first ``plan``; a later, larger plan is refused. 0.7.4 takes
  the budget as the constructor argument ``max_total_num_rows``; before that the only way to set it
  up front is the private attribute ``_max_total_num_rows`` (present from 0.5 to 0.7.4).
* **q rows against the plan.** From 0.7 the paged prefill ``run`` refuses a ``q`` whose row count
  differs from the plan's ``qo_indptr[-1]`` (kept in the private ``_qo_indptr_last``). A captured
  graph runs on static shapes, so its ``q`` has the bucket's row count while each plan holds the
  step's tokens; the kernel reads the row ranges from the device-side ``qo_indptr`` and never
  touches the rows past them (0.5.3 had no such check). For such a static run only, the check is
  told the static row count. Eager runs hand FlashInfer exactly the planned rows, on every version.
* **The backend per plan.** 0.7.4's paged prefill with ``backend="auto"`` picks fa2 or fa3 at each
  plan from the longest query; earlier releases pick once. It only changes which kernels a first
  use may compile (``picks_backend_per_plan``), and so what ``mstar warmup`` runs.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

log = logging.getLogger("mstar.flashinfer")

# The releases run end to end on the H200 (GPU conformance, graphs, the wrapper benchmark);
# plugins/flashinfer/pyproject.toml declares the range between them.
VERIFIED = ("0.5.3", "0.7.2.post1", "0.7.4")


def library_version(fi: Any) -> str:
    return str(getattr(fi, "__version__", "unknown"))


def takes_row_budget(cls: type) -> bool:
    """Does this paged prefill class take ``max_total_num_rows`` at construction (0.7.4 on)?"""
    try:
        return "max_total_num_rows" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # a C extension or an odd wrapper: take the older path
        return False


def graph_prefill(cls: type, rows: int, *args: Any, **kwargs: Any) -> Any:
    """A graph-mode paged prefill wrapper whose token budget is ``rows`` from the start, so a first
    plan with fewer tokens does not refuse every larger one."""
    if takes_row_budget(cls):
        return cls(*args, **kwargs, max_total_num_rows=int(rows))
    inner = cls(*args, **kwargs)
    if not hasattr(inner, "_max_total_num_rows"):
        # Neither way exists: the first plan fixes the budget, and a larger plan later is refused by
        # FlashInfer itself. Say so once, rather than fail later without a hint.
        log.warning("FlashInfer's %s takes neither max_total_num_rows nor _max_total_num_rows; in graph mode no "
                    "plan may hold more tokens than its first", cls.__name__)
        return inner
    inner._max_total_num_rows = int(rows)
    return inner


def picks_backend_per_plan(inner: Any, backend: str) -> bool:
    """Does this paged prefill wrapper choose fa2 or fa3 anew at each plan (0.7.4, backend "auto":
    fa2 for plans whose longest query is at most 64 tokens on Hopper)? Then the two are separate
    first uses (mstar_flashinfer.jit_notice)."""
    return backend == "auto" and hasattr(inner, "_determine_auto_backend")


def checks_q_rows(inner: Any) -> bool:
    """Does this FlashInfer wrapper refuse a q whose rows differ from its plan (0.7 on)?"""
    return hasattr(inner, "_qo_indptr_last")


def allow_static_rows(inner: Any, rows: int) -> None:
    """Before a static-shape (graph) run with ``rows`` rows of q over a plan holding fewer: let
    FlashInfer's row check (0.7 on) pass. The next ``plan`` resets it to the plan's own count."""
    if checks_q_rows(inner):
        inner._qo_indptr_last = int(rows)

