"""What differs between the FlashInfer releases this plugin supports, in one place.

Verified on the H200 (see ``results/README.md``): 0.5.3, 0.7.2.post1 and 0.7.4. Each difference is
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
  touches the rows past them (0.5.3 had no such check). A graph-mode or mixed wrapper tells the
  check the row count of each run (``tell_q_rows``); an eager wrapper's runs hold exactly the
  planned rows and need nothing.
* **The backend per plan.** 0.7.4's paged prefill with ``backend="auto"`` picks fa2 or fa3 at each
  plan from the longest query; earlier releases pick once. Eager wrappers keep 0.7.4's choice (it
  changes which kernels a first use may compile: ``picks_backend_per_plan``, and so what
  ``mstar warmup`` runs); a graph-mode wrapper would keep its first plan's choice for good, so
  "auto" is resolved at construction instead (``graph_backend``).
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


def takes_row_budget(cls: type[Any]) -> bool:
    """Does this paged prefill class take ``max_total_num_rows`` at construction (0.7.4 on)?"""
    try:
        return "max_total_num_rows" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # a C extension or an odd wrapper: take the older path
        return False


def graph_prefill(cls: type[Any], rows: int, *args: Any, **kwargs: Any) -> Any:
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


def graph_backend(fi: Any, backend: str, device: Any) -> str:
    """The backend to build a graph-mode paged prefill with. Where ``"auto"`` chooses per plan
    (0.7.4), a graph-mode wrapper keeps whatever its *first* plan chose -- fa2 if that plan's
    prompts were all 64 tokens or shorter -- for every later plan, long prompts included (FlashInfer
    cannot switch under a captured graph). So "auto" is resolved here, up front, the way earlier
    releases resolve it for every plan: FlashInfer's own ``determine_attention_backend`` for
    fp16/bf16 without custom mask or RoPE (fa3 on Hopper). Elsewhere ``backend`` is returned as is."""
    if backend != "auto" or not hasattr(fi.BatchPrefillWithPagedKVCacheWrapper, "_determine_auto_backend"):
        return backend
    try:
        import torch
        from flashinfer.utils import determine_attention_backend

        chosen = str(determine_attention_backend(device, 0, False, False, torch.bfloat16, torch.bfloat16))
    except Exception as e:  # an API change: keep "auto" (correct, maybe slower for long prompts) and say so
        log.warning("FlashInfer %s: could not resolve backend 'auto' for a graph-mode prefill (%s: %s); its first "
                    "plan will fix fa2 or fa3", library_version(fi), type(e).__name__, e)
        return backend
    log.info("FlashInfer %s: graph-mode paged prefill built with backend %r (auto, resolved up front: a graph-mode "
             "wrapper keeps its first plan's choice)", library_version(fi), chosen)
    return chosen


def checks_q_rows(inner: Any) -> bool:
    """Does this FlashInfer wrapper refuse a q whose rows differ from its plan (0.7 on)?"""
    return hasattr(inner, "_qo_indptr_last")


def tell_q_rows(inner: Any, rows: int) -> None:
    """Before a run that hands this wrapper ``rows`` rows of q: where FlashInfer checks them against
    the plan (0.7 on), make its record say ``rows``. Called before every run of a graph-mode or mixed
    wrapper -- not only static ones, since a static run's value would otherwise stay for a later run
    of the planned size -- and only after mstar's own check accepted ``rows`` (the plan's tokens, or
    the static size whose rows past the plan the kernel never reads)."""
    if checks_q_rows(inner):
        inner._qo_indptr_last = int(rows)
