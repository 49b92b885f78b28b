"""Conformance of a wrapper used as the managers use it: built once, planned again and again
with different shapes (every plan must replace the last one whole), and, for capturable
wrappers on CUDA, captured once in a CUDA graph and replayed after each new plan.

The plain suite (:mod:`.conformance`) builds a fresh wrapper per case, so a wrapper that keeps
its first plan passes it; these checks do not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mstar_core.errors import InputError
from mstar_core.testing.conformance import (
    CHECKS,
    PagedCase,
    RaggedCase,
    WrapperSet,
    assert_close,
    make_paged,
    paged_oracle,
)

PAGE_SIZE, KV_HEADS, GQA = 16, 2, 4

# Steps of different batch sizes and lengths, in an order that grows and shrinks every size;
# prompts over 64 tokens among short ones (FlashInfer 0.7.4 "auto" picks its kernel per plan).
STEPS: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {
    "prefill": [((5, 40, 1, 17), (0, 30, 16, 2)), ((64,), (100,)), ((1, 2, 3), (0, 15, 16)),
                ((33, 33, 33, 1), (1, 2, 3, 4)), ((100, 20), (7, 0))],
    "decode": [((1,) * 8, (0, 15, 16, 40, 3, 99, 7, 1)), ((1,) * 3, (200, 1, 64)), ((1,) * 8, (5,) * 8)],
    "mixed": [((1, 9, 1, 17, 1, 1), (12, 0, 16, 2, 1, 40)), ((1, 1, 1), (3, 4, 5)), ((30, 1, 2), (3, 100, 0)),
              ((1, 1, 1, 1, 1, 1, 1, 1), (0, 1, 2, 3, 4, 5, 6, 7)), ((1, 90, 1), (30, 5, 7))],
    "ragged": [((1, 9, 16, 33), (0, 7, 16, 1)), ((70,), (5,)), ((2, 3), (40, 0)), ((8, 8, 8, 8, 8), (1, 2, 3, 4, 5))],
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
    dev = torch.device(backend.device)
    hq = KV_HEADS * GQA
    if kind == "ragged":
        return backend.ragged(hq, KV_HEADS, head_dim, dev, workspace_buffer=backend.workspace())
    if kind == "mixed":
        return backend.mixed(backend.workspace(), backend.workspace(), hq, KV_HEADS, head_dim, PAGE_SIZE, BATCH,
                             TOKENS, PAGES, PREFILL_ROWS, dev)
    cls = backend.prefill if kind == "prefill" else backend.decode
    if not graph:
        return cls(backend.workspace(), hq, KV_HEADS, head_dim, PAGE_SIZE, device=dev)
    sizes = {"max_total_tokens": TOKENS} if kind == "prefill" else {}
    return cls(backend.workspace(), hq, KV_HEADS, head_dim, PAGE_SIZE, batch_size=BATCH, max_num_pages=PAGES,
               device=dev, accelerator_graph=True, **sizes)


def check_replan(backend: WrapperSet, kind: str, head_dim: int = 128) -> float:
    """One wrapper planned and run for each step of :data:`STEPS` -- the second with a window,
    the third with an explicit ``sm_scale`` -- then for the first again; every output checked,
    so a plan that keeps anything of the one before shows. Returns the largest relative error."""
    w = _wrapper(backend, kind, head_dim, graph=False)
    cases = steps(kind, head_dim)
    cases[1] = dataclasses.replace(cases[1], window_left=6)
    cases[2] = dataclasses.replace(cases[2], sm_scale=0.1)
    return max(CHECKS[kind](backend, case, wrapper=w) for case in [*cases, cases[0]])


def check_replay(backend: WrapperSet, kind: str, head_dim: int = 128) -> float:
    """CUDA only: a graph-mode wrapper planned for the first step, its ``run`` captured once,
    then for every step a fresh plan and a replay of that graph; the replayed output checked
    (it is poisoned with NaN before each replay, so a replay that skips rows shows)."""
    if torch.device(backend.device).type != "cuda":
        raise InputError(f"check_replay needs a CUDA device, got {backend.device!r}")
    w = _wrapper(backend, kind, head_dim, graph=True)
    dev, dt = backend.device, backend.dtype
    cases = paged_steps(kind, head_dim)
    datas = [make_paged(c, dev, dt) for c in cases]
    q_static = torch.randn(BATCH if kind == "decode" else TOKENS, KV_HEADS * GQA, head_dim, device=dev, dtype=dt)
    layer = torch.randn(PAGES + 1, 2, PAGE_SIZE, KV_HEADS, head_dim, device=dev, dtype=dt)

    def plan(d: Any) -> None:
        if kind == "decode":
            w.plan(d.kv_indptr, backend.indices(d), d.last_page_len, dtype=dt, kv_lens=d.kv_lens)
        else:  # the mixed split is host arithmetic: host page indices, as the manager passes them
            idx = d.kv_indices if kind == "mixed" else backend.indices(d)
            w.plan(d.qo_indptr, d.kv_indptr, idx, d.last_page_len, causal=True, dtype=dt, kv_lens=d.kv_lens)

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
        errors.append(assert_close(backend, f"{kind} replay", case, out_static[:n], paged_oracle(case, d, True)))
    return max(errors)
