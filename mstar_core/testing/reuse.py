"""Conformance of wrappers used as the managers use them: one built once and planned again and
again with different shapes (every plan must replace the last one whole, and a refused plan
must not leave half of itself behind); several of one backend planned with different windows
and scales and run in turn, as one per layer window; and, for capturable wrappers on CUDA, one
captured once in a CUDA graph and replayed after each new plan. Every output is held until the
end of its sequence: a later run may not write into it.

The plain suite (:mod:`.conformance`) builds a fresh wrapper per case, so a wrapper that keeps
its first plan, or state shared by all its instances, passes it; these checks do not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from mstar_core.attention import calls
from mstar_core.attention.plans import PagedPlan, WrapperSize, paged_plan
from mstar_core.errors import InputError
from mstar_core.testing import conformance as C
from mstar_core.testing.conformance import (
    RUNS,
    PagedCase,
    RaggedCase,
    Ran,
    WrapperSet,
    assert_close,
    make_paged,
    paged_oracle,
)
from mstar_core.testing.rules import RuleError, at, bits_equal, difference

PAGE_SIZE, KV_HEADS, GQA = 16, 2, 4

# Steps of different batch sizes and lengths, in an order that grows and shrinks every size;
# prompts over 64 tokens among short ones (FlashInfer 0.7.4 "auto" picks its kernel per plan).
# Case sizes, left out of mutation runs: the tests pin what the comment above says of them.
STEPS: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {
    "prefill": [
        ((5, 40, 1, 17), (0, 30, 16, 2)),  # pragma: no mutate
        ((64,), (100,)),  # pragma: no mutate
        ((1, 2, 3), (0, 15, 16)),  # pragma: no mutate
        ((33, 33, 33, 1), (1, 2, 3, 4)),  # pragma: no mutate
        ((100, 20), (7, 0)),  # pragma: no mutate
    ],
    "decode": [
        ((1, 1, 1, 1, 1, 1, 1, 1), (0, 15, 16, 40, 3, 99, 7, 1)),  # pragma: no mutate
        ((1, 1, 1), (200, 1, 64)),  # pragma: no mutate
        ((1, 1, 1, 1, 1, 1, 1, 1), (5, 5, 5, 5, 5, 5, 5, 5)),  # pragma: no mutate
    ],
    "mixed": [
        ((1, 9, 1, 17, 1, 1), (12, 0, 16, 2, 1, 40)),  # pragma: no mutate
        ((1, 1, 1), (3, 4, 5)),  # pragma: no mutate
        ((30, 1, 2), (3, 100, 0)),  # pragma: no mutate
        ((1, 1, 1, 1, 1, 1, 1, 1), (0, 1, 2, 3, 4, 5, 6, 7)),  # pragma: no mutate
        ((1, 90, 1), (30, 5, 7)),  # pragma: no mutate
    ],
    "ragged": [
        ((1, 9, 16, 33), (0, 7, 16, 1)),  # pragma: no mutate
        ((70,), (5,)),  # pragma: no mutate
        ((2, 3), (40, 0)),  # pragma: no mutate
        ((8, 8, 8, 8, 8), (1, 2, 3, 4, 5)),  # pragma: no mutate
    ],
}
# What a graph-mode wrapper is sized for: every step above fits.
BATCH, TOKENS, PAGES, PREFILL_ROWS = 8, 128, 96, 4


def steps(kind: str, head_dim: int = 128) -> list[PagedCase | RaggedCase]:
    """The step sequence of ``kind`` ("prefill", "decode", "mixed", "ragged") as cases."""
    if kind == "ragged":
        return [RaggedCase(head_dim, GQA, q, p, num_kv_heads=KV_HEADS, seed=1100 + i)
                for i, (q, p) in enumerate(STEPS[kind])]
    return [*paged_steps(kind, head_dim)]


def paged_steps(kind: str, head_dim: int = 128) -> list[PagedCase]:
    """The step sequence of a paged ``kind`` ("prefill", "decode", "mixed") as cases."""
    return [PagedCase(PAGE_SIZE, head_dim, GQA, q, p, num_kv_heads=KV_HEADS, seed=1100 + i)
            for i, (q, p) in enumerate(STEPS[kind])]


def _wrapper(backend: WrapperSet, kind: str, head_dim: int, graph: bool) -> Any:
    size = WrapperSize(KV_HEADS * GQA, KV_HEADS, head_dim, torch.device(backend.device),
                       0 if kind == "ragged" else PAGE_SIZE, workspace_bytes=backend.workspace_bytes)
    if kind == "mixed":
        size = C.mixed_size(size, BATCH, TOKENS, PAGES, PREFILL_ROWS)
    elif graph:
        size = dataclasses.replace(size, batch_size=BATCH, max_num_pages=PAGES, accelerator_graph=True,
                                   max_total_tokens=TOKENS if kind == "prefill" else None)
    return calls.build_wrapper(getattr(backend, kind), C.KIND_CAPABILITY[kind], size, backend.version(kind))


def check_held(held: Sequence[Ran], what: str) -> None:
    """Every output of a sequence still holds the value it had when it was returned (rule
    ``owned-output``)."""
    for i, ran in enumerate(held):
        if not bits_equal(ran.out, ran.value):
            d, idx = difference(ran.out, ran.value)
            raise RuleError("owned-output", ran.where, f"the output of run {i + 1} of {len(held)}, held while "
                            f"{what}, changed: largest change {d:.3g} at {at(idx)}", d)


def check_replan(backend: WrapperSet, kind: str, head_dim: int = 128) -> float:
    """One wrapper planned and run for each step of :data:`STEPS` -- the second with a window,
    the third with an explicit ``sm_scale`` -- then for the first again; every output checked,
    and held to the end, so a plan that keeps anything of the one before, or a run that writes
    into an earlier output, shows. Returns the largest relative error."""
    w = _wrapper(backend, kind, head_dim, graph=False)
    cases = steps(kind, head_dim)
    cases[1] = dataclasses.replace(cases[1], window_left=6)
    cases[2] = dataclasses.replace(cases[2], sm_scale=0.1)
    held = []
    for i, case in enumerate([*cases, cases[0]]):
        try:
            held.append(RUNS[kind](backend, case, wrapper=w))
        except Exception as e:
            # NaN from slots the step's rows do not own, too: a plan that kept the last one's page table reads them
            if i == 0 or (isinstance(e, RuleError) and e.rule not in ("oracle", "shape", "stale-slots")):
                raise
            RUNS[kind](backend, case)  # alone, through a fresh wrapper: it may just be wrong
            what = e.detail if isinstance(e, RuleError) else f"{type(e).__name__}: {e}"
            raise RuleError("replan", f"{backend.name} {kind} [{case}]", f"step {i + 1} of {len(cases) + 1} on one "
                            f"wrapper: {what}; through a fresh wrapper it passes",
                            e.error if isinstance(e, RuleError) else None) from e
    check_held(held, "the later steps re-planned the wrapper and ran")
    return max(r.error for r in held)


# Per-layer windows and scales: (window_left, sm_scale) of each wrapper, then the layers in order.
LAYER_PLANS = ((-1, None), (3, 0.1), (9, 0.3))
LAYER_ORDER = (0, 1, 2, 1, 0, 2)


def _layer_case(kind: str, head_dim: int, window_left: int, sm_scale: float | None, seed: int
                ) -> PagedCase | RaggedCase:
    # Case sizes, left out of mutation runs: a test pins that every row's keys reach past each window.
    q, p = {"prefill": ((5, 12, 1), (20, 11, 40)), "decode": ((1,) * 5, (20, 11, 40, 16, 33)),  # pragma: no mutate
            "mixed": ((1, 12, 1, 6), (20, 11, 40, 16)), "ragged": ((5, 12, 1), (20, 11, 40))}[kind]  # pragma: no mutate
    if kind == "ragged":
        return RaggedCase(head_dim, GQA, q, p, num_kv_heads=KV_HEADS, window_left=window_left, sm_scale=sm_scale,
                          seed=seed)
    return PagedCase(PAGE_SIZE, head_dim, GQA, q, p, num_kv_heads=KV_HEADS, window_left=window_left,
                     sm_scale=sm_scale, seed=seed)


def check_layers(backend: WrapperSet, kind: str, head_dim: int = 128) -> float:
    """Wrappers of one capability, one per (window, scale) of :data:`LAYER_PLANS` (one per
    layer window, as the managers build them under ``layer_windows``), all planned first for
    rows of the same lengths (each its own page table); then the layers of :data:`LAYER_ORDER`
    run in turn, each on its own data through its window's wrapper, every output checked and
    held to the end. A window, scale, page table or output buffer one wrapper shares with another
    shows. Returns the largest relative error."""
    wrappers, plans = [], []
    for i, (window, scale) in enumerate(LAYER_PLANS):
        case = _layer_case(kind, head_dim, window, scale, 1500 + i)
        plans.append(case)
        wrappers.append(_build_and_plan(backend, kind, case))
    held, errors = [], []
    for n, i in enumerate(LAYER_ORDER):
        case = dataclasses.replace(plans[i], layer=n + 1)  # this layer's q and K/V; the plan's pages
        try:
            ran = RUNS[kind](backend, case, wrapper=_Planned(wrappers[i]))
        except RuleError as e:
            if e.rule != "oracle":
                raise
            RUNS[kind](backend, case)  # alone, through a fresh wrapper: it may just be wrong
            win = f"window {plans[i].window_left}" if plans[i].window_left >= 0 else "no window"
            sc = f"scale {plans[i].sm_scale:g}" if plans[i].sm_scale is not None else "the default scale"
            raise RuleError("independent-wrappers", e.where, f"layer {n} ({win}, {sc}) through its wrapper, "
                            f"one of {len(wrappers)} planned with other windows and scales before any ran: "
                            f"{e.detail}; through a fresh wrapper it passes", e.error) from e
        held.append(ran)
        errors.append(ran.error)
    check_held(held, "the other layers ran")
    return max(errors)


class _Planned:
    """A wrapper already planned for a case's rows: a case run through it plans nothing (the
    per-layer wrappers were planned before any layer ran), only runs."""

    def __init__(self, w: Any) -> None:
        self._w = w

    def plan(self, *args: Any, **kwargs: Any) -> None:
        pass

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._w.run(*args, **kwargs)


def _build_and_plan(backend: WrapperSet, kind: str, case: PagedCase | RaggedCase) -> Any:
    if kind == "ragged":
        assert isinstance(case, RaggedCase)
        w = C.build(backend, kind, case)
        C.plan_ragged(case, C.make_ragged(case, backend.device, backend.dtype), w, api_version=backend.version(kind))
        return w
    assert isinstance(case, PagedCase)
    data = make_paged(case, backend.device, backend.dtype, stale_nan=True)
    w = C.build(backend, kind, case, data)
    C.plan_paged(backend, kind, case, data, w)
    return w


# A keyword no wrapper implements: a plan given it must raise (and leave no trace of itself).
UNKNOWN_KEYWORD = "mstar_check_unknown_keyword"


def foreign_plan(backend: WrapperSet, kind: str, case: PagedCase | RaggedCase, data: Any) -> PagedPlan:
    """A plan of another capability than ``kind``'s (a 2.0 wrapper must refuse it): a paged
    ``case``'s plan relabelled, or, for the ragged wrapper, a one-row paged plan."""
    if kind == "ragged":
        one = torch.tensor([0, 1], dtype=torch.int32)
        return paged_plan("paged_prefill", one, one, one[:1], one[1:], 1, backend.dtype)
    assert isinstance(case, PagedCase)
    plan = C.make_plan(backend, kind, case, data)
    return dataclasses.replace(plan, kind="paged_prefill" if kind == "mixed" else "mixed")


def check_refused(backend: WrapperSet, kind: str, head_dim: int = 128) -> float:
    """One wrapper planned for a step with a window and a scale and run; then planned for
    another step (other rows, no window, another scale) with a keyword it does not implement,
    which it must refuse; then run on the first step's inputs, which must give the first plan's
    output (or be refused: then the next plan must work). Returns the largest relative error."""
    w = _wrapper(backend, kind, head_dim, graph=False)
    first = steps(kind, head_dim)[0]
    first = dataclasses.replace(first, window_left=4, sm_scale=0.2)
    other = dataclasses.replace(steps(kind, head_dim)[2], window_left=-1, sm_scale=0.5)
    ran = RUNS[kind](backend, first, wrapper=w)
    if kind == "ragged":
        assert isinstance(other, RaggedCase)
        bad: Any = C.make_ragged(other, backend.device, backend.dtype)
        refuse = lambda: C.plan_ragged(other, bad, w, extra={UNKNOWN_KEYWORD: True},  # noqa: E731
                                       api_version=backend.version(kind))
    else:
        assert isinstance(other, PagedCase)
        bad = make_paged(other, backend.device, backend.dtype, stale_nan=True)
        refuse = lambda: C.plan_paged(backend, kind, other, bad, w, extra={UNKNOWN_KEYWORD: True})  # noqa: E731
    if calls.takes_plan_objects(backend.version(kind)):  # 2.0: a typed plan; one of another capability
        foreign = foreign_plan(backend, kind, other, bad)
        refuse = lambda: w.plan(foreign)  # noqa: E731
    where = f"{backend.name} {kind} [{other}]"
    try:
        refuse()
    except Exception:  # refused, as it must be: now the first plan, or a refusal to run
        pass
    else:
        what = (f"a {foreign.kind} plan" if calls.takes_plan_objects(backend.version(kind))
                else f"the keyword {UNKNOWN_KEYWORD}=True")
        raise RuleError("unknown-keyword", where, f"plan accepted {what}")
    try:
        again = RUNS[kind](backend, first, wrapper=_Planned(w))
    except RuleError as e:
        if e.rule not in ("oracle", "shape"):
            raise
        raise RuleError("refused-plan", e.where, f"a run after a refused plan (of [{other}], with "
                        f"{UNKNOWN_KEYWORD}): {e.detail}", e.error) from e
    except Exception:  # refuses every run until the next plan: the next plan must work
        return max(ran.error, RUNS[kind](backend, steps(kind, head_dim)[1], wrapper=w).error)
    check_held([ran, again], "a refused plan and another run followed")
    return max(ran.error, again.error)


# A multi-token decode step (uniform rows of a few queries), replayed on the prefill wrapper.
# Case sizes, left out of mutation runs: a test pins what the comment above says of them.
MULTI_TOKEN_STEP = ((4,) * 8, (3, 17, 0, 40, 9, 1, 30, 12))  # pragma: no mutate


def check_replay(backend: WrapperSet, kind: str, head_dim: int = 128, multi_token: bool = False) -> float:
    """CUDA only: a graph-mode wrapper planned for the first step, its ``run`` captured once,
    then for every step a fresh plan and a replay of that graph; the replayed output checked
    (it is poisoned with NaN before each replay, so a replay that skips rows shows).
    ``multi_token`` (prefill): a step of uniform rows of 4 queries too, as multi-token decode is
    captured."""
    if torch.device(backend.device).type != "cuda":
        raise InputError(f"check_replay needs a CUDA device, got {backend.device!r}")
    w = _wrapper(backend, kind, head_dim, graph=True)
    dev, dt = backend.device, backend.dtype
    cases = paged_steps(kind, head_dim)
    if multi_token and kind == "prefill":
        q, p = MULTI_TOKEN_STEP
        cases.append(PagedCase(PAGE_SIZE, head_dim, GQA, q, p, num_kv_heads=KV_HEADS, seed=1190))
    datas = [make_paged(c, dev, dt, stale_nan=True) for c in cases]
    q_static = torch.randn(BATCH if kind == "decode" else TOKENS, KV_HEADS * GQA, head_dim, device=dev, dtype=dt)
    layer = torch.randn(PAGES + 1, 2, PAGE_SIZE, KV_HEADS, head_dim, device=dev, dtype=dt)

    def plan(d: Any) -> None:  # the mixed split is host arithmetic: host page indices, as the manager passes them
        p = paged_plan(C.KIND_CAPABILITY[kind], None if kind == "decode" else d.qo_indptr, d.kv_indptr,
                       d.kv_indices if kind == "mixed" else backend.indices(d), d.last_page_len, PAGE_SIZE, dt,
                       kv_lens=d.kv_lens, who="mstar check (replay)")
        calls.plan_paged(w, p, backend.version(kind))

    plan(datas[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graphs asks
        w.run(q_static, layer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = w.run(q_static, layer)
    errors = []
    for case, d in zip(cases, datas, strict=True):
        n = d.q.shape[0]
        layer.zero_()
        layer[: d.layer.shape[0]].copy_(d.layer)
        q_static.normal_()
        q_static[:n].copy_(d.q)
        out_static.fill_(float("nan"))
        plan(d)
        graph.replay()
        torch.cuda.synchronize()
        try:
            errors.append(assert_close(backend, f"{kind} replay", case, out_static[:n], paged_oracle(case, d, True)))
        except RuleError as e:
            # NaN too: rows the replay skipped, or pages of the plan the graph was captured with
            if e.rule not in ("oracle", "stale-slots"):
                raise
            raise RuleError("replay", e.where, e.detail, e.error) from e
    return max(errors)
