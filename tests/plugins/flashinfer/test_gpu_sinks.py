"""On the GPU: sink logits through the three paged wrappers against the real FlashInfer's
AttentionSink variant, in bf16, against mstar's float64 oracle: the conformance suite's sink cases
(alone and windowed) eager, and graph-mode wrappers captured once and replayed after fresh plans.
Head dims 64 and 128, page size 16. Errors go to ``$OUT/flashinfer_gpu_sinks.json`` when ``OUT`` is set.

Each (head dim, fa2/fa3, window or not) is one JIT compile of the variant (20-120 s on an H200 the
first time; cached after), so a cold run takes several minutes.
"""

from __future__ import annotations

import pytest
import torch

from mstar_core.testing import conformance as C
from mstar_core.testing.conformance import PagedCase, assert_close, make_paged, paged_oracle

from ...helpers import write_results
from .test_gpu_flashinfer import REAL, REAL_DEVICE_INDICES

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
HEAD_DIMS = (64, 128)
SINKS_ONLY = ("sink_logits",)
RESULTS: list[dict] = []

# What a graph-mode wrapper is sized for (every step below fits), and the steps it replays.
PAGE_SIZE, KV_HEADS, GQA = 16, 2, 4
BATCH, TOKENS, PAGES, PREFILL_ROWS = 8, 128, 96, 4
STEPS = {
    "prefill": [((5, 40, 1, 17), (0, 30, 16, 2)), ((64,), (100,)), ((1, 2, 3), (0, 15, 16)), ((100, 20), (7, 0))],
    "decode": [((1,) * 8, (0, 15, 16, 40, 3, 99, 7, 1)), ((1,) * 3, (200, 1, 64)), ((1,) * 8, (5,) * 8)],
    "mixed": [((1, 9, 1, 17, 1, 1), (12, 0, 16, 2, 1, 40)), ((1, 1, 1), (3, 4, 5)), ((30, 1, 2), (3, 100, 0)),
              ((1, 90, 1), (30, 5, 7))],
}


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    write_results("flashinfer_gpu_sinks", RESULTS, ("flashinfer-python",))


@pytest.fixture
def real():
    fi = pytest.importorskip("flashinfer")
    assert not getattr(fi, "STANDIN", False), "the stand-in is on sys.path; expected the real flashinfer"
    return fi


def _cases(kind):
    cases = [c for d in HEAD_DIMS for c in C.feature_cases(kind, SINKS_ONLY, page_sizes=(PAGE_SIZE,), head_dim=d)]
    assert cases and all(c.sinks for c in cases)
    return cases


CHECK = {"prefill": C.check_prefill, "decode": C.check_decode, "mixed": C.check_mixed}


@pytest.mark.parametrize("kind,case", [(k, c) for k in CHECK for c in _cases(k)], ids=str)
@pytest.mark.parametrize("device_indices", [False, True], ids=["host-indices", "device-indices"])
def test_sinks_eager(real, kind, case, device_indices):
    if kind == "mixed" and device_indices:
        pytest.skip("the mixed wrapper splits host page indices")
    backend = REAL_DEVICE_INDICES if device_indices else REAL
    err = CHECK[kind](backend, case)
    RESULTS.append({"test": f"eager-{kind}", "backend": backend.name, "case": str(case), "rel_error": err})


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_sinks_eager_prefill_on_fa2(real, head_dim):
    """Eager "auto" prefill runs fa3 on Hopper; the fa2 build of the variant too, asked for by name."""
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    case = PagedCase(PAGE_SIZE, head_dim, GQA, (5, 40, 1), (0, 30, 16), num_kv_heads=KV_HEADS, sinks=True, seed=7)
    d = make_paged(case, "cuda", BF16)
    w = FlashInferPrefillWrapper(REAL.workspace(), KV_HEADS * GQA, KV_HEADS, head_dim, PAGE_SIZE, device="cuda",
                                 backend="fa2")
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, causal=True, dtype=BF16, kv_lens=d.kv_lens,
           sink_logits=True)
    sinks = C.sink_logits(case, "cuda")
    err = assert_close(REAL, "prefill fa2", case, w.run(d.q, d.layer, sinks=sinks), paged_oracle(case, d, True, sinks))
    RESULTS.append({"test": "eager-prefill-fa2", "case": str(case), "rel_error": err})


def _graph_wrapper(kind, head_dim):
    from mstar_flashinfer.decode import FlashInferDecodeWrapper
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    hq, dev = KV_HEADS * GQA, torch.device("cuda")
    if kind == "mixed":
        return FlashInferMixedWrapper(REAL.workspace(), REAL.workspace(), hq, KV_HEADS, head_dim, PAGE_SIZE, BATCH,
                                      TOKENS, PAGES, PREFILL_ROWS, dev)
    if kind == "decode":
        return FlashInferDecodeWrapper(REAL.workspace(), hq, KV_HEADS, head_dim, PAGE_SIZE, batch_size=BATCH,
                                       max_num_pages=PAGES, device=dev, accelerator_graph=True)
    return FlashInferPrefillWrapper(REAL.workspace(), hq, KV_HEADS, head_dim, PAGE_SIZE, batch_size=BATCH,
                                    max_total_tokens=TOKENS, max_num_pages=PAGES, device=dev, accelerator_graph=True)


@pytest.mark.parametrize("window_left", [-1, 24])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_sinks_graph_replay_with_fresh_plans(real, kind, head_dim, window_left):
    """A graph-mode wrapper planned with sink_logits=True for the first step, its run captured
    once, then per step a fresh plan and a replay (output poisoned with NaN before each), each
    against the float64 oracle with the same sinks."""
    w = _graph_wrapper(kind, head_dim)
    cases = [PagedCase(PAGE_SIZE, head_dim, GQA, q, p, num_kv_heads=KV_HEADS, window_left=window_left, sinks=True,
                       seed=1300 + i) for i, (q, p) in enumerate(STEPS[kind])]
    datas = [make_paged(c, "cuda", BF16, stale_nan=True) for c in cases]
    sinks = C.sink_logits(cases[0], "cuda")  # one layer's sinks, the same tensor at capture and every replay
    q_static = torch.randn(BATCH if kind == "decode" else TOKENS, KV_HEADS * GQA, head_dim, device="cuda", dtype=BF16)
    layer = torch.randn(PAGES + 1, 2, PAGE_SIZE, KV_HEADS, head_dim, device="cuda", dtype=BF16)

    def plan(d):
        if kind == "decode":
            w.plan(d.kv_indptr, REAL.indices(d), d.last_page_len, dtype=BF16, kv_lens=d.kv_lens,
                   window_left=window_left, sink_logits=True)
        else:  # the mixed split is host arithmetic: host page indices
            idx = d.kv_indices if kind == "mixed" else REAL.indices(d)
            w.plan(d.qo_indptr, d.kv_indptr, idx, d.last_page_len, causal=True, dtype=BF16, kv_lens=d.kv_lens,
                   window_left=window_left, sink_logits=True)

    plan(datas[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graphs asks
        w.run(q_static, layer, sinks=sinks)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = w.run(q_static, layer, sinks=sinks)
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
        ref = paged_oracle(case, d, True, sinks)
        errors.append(assert_close(REAL, f"{kind} sink replay", case, out_static[:n], ref))
    RESULTS.append({"test": f"graph-{kind}", "head_dim": head_dim, "window_left": window_left, "rel_errors": errors})
    assert max(errors) <= C.TOLERANCE[BF16]
