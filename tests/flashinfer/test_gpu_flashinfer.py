"""On the GPU: the conformance suite against the real FlashInfer (0.5.3, 0.7.2.post1 and 0.7.4 verified) in bf16 (eager, and
replayed from captured CUDA graphs with fresh plans between replays), the same suite against the
stand-in on the GPU, and the stand-in's signatures checked against the real library's.

Head dim 128 only (its bf16 modules come precompiled; every other head dim or the sliding-window
variant is another JIT compile of 20-80 s) -- the window cases are moved to head dim 128 too.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys

import pytest
import torch

from mstar_core.testing import conformance as C
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _at_128(cases):
    return [c if c.head_dim == 128 else dataclasses.replace(c, head_dim=128) for c in cases]


def _ws(name, device_indices=False):
    return C.WrapperSet(name, FlashInferPrefillWrapper, FlashInferDecodeWrapper, FlashInferMixedWrapper,
                        FlashInferPrefixedPrefillWrapper, device="cuda", dtype=BF16, workspace_bytes=128 << 20,
                        device_indices=device_indices)


REAL, STANDIN = _ws("flashinfer"), _ws("flashinfer-standin-gpu")
REAL_DEVICE_INDICES = _ws("flashinfer-device-indices", device_indices=True)
PREFILL = _at_128([c for c in C.prefill_cases() if c.head_dim == 128 or c.window_left >= 0 or c.sm_scale])
DECODE = _at_128([c for c in C.decode_cases() if c.head_dim == 128 or c.window_left >= 0])
MIXED = _at_128([c for c in C.mixed_cases() if c.head_dim == 128 or c.window_left >= 0])
RAGGED = [c for c in C.ragged_cases() if c.head_dim == 128]


@pytest.fixture
def real_flashinfer():
    fi = pytest.importorskip("flashinfer")
    assert not getattr(fi, "STANDIN", False), "the stand-in is on sys.path; expected the real flashinfer"
    return fi


@pytest.fixture(params=["real", "real-device-indices", "standin"])
def backend(request):
    if request.param.startswith("real"):
        request.getfixturevalue("real_flashinfer")
        return REAL if request.param == "real" else REAL_DEVICE_INDICES
    request.getfixturevalue("standin_flashinfer_like_real")
    return STANDIN


@pytest.mark.parametrize("case", PREFILL, ids=str)
def test_prefill(backend, case):
    C.check_prefill(backend, case)


@pytest.mark.parametrize("case", DECODE, ids=str)
def test_decode(backend, case):
    C.check_decode(backend, case)


@pytest.mark.parametrize("case", MIXED, ids=str)
def test_mixed(backend, case):
    C.check_mixed(backend, case)


@pytest.mark.parametrize("case", RAGGED, ids=str)
def test_ragged(backend, case):
    C.check_ragged(backend, case)


# -- CUDA graphs: capture once, replan and replay ------------------------------------------------

PS, HKV, GQA, D = 16, 2, 4, 128
GRAPH_STEPS = {
    # short prompts first, then one over 64 tokens (0.7.4 "auto" would keep the first plan's fa2)
    "prefill": [((5, 40, 1, 17), (0, 30, 16, 2)), ((64,), (100,)), ((1, 2, 3), (0, 15, 16)), ((33, 33, 33, 1), (1, 2, 3, 4)),
                ((100, 20), (7, 0))],
    "decode": [((1,) * 8, (0, 15, 16, 40, 3, 99, 7, 1)), ((1,) * 3, (200, 1, 64)), ((1,) * 8, (5,) * 8)],
    "mixed": [((1, 9, 1, 17, 1, 1), (12, 0, 16, 2, 1, 40)), ((1, 1, 1), (3, 4, 5)), ((30, 1, 2), (3, 100, 0)),
              ((1, 1, 1, 1, 1, 1, 1, 1), (0, 1, 2, 3, 4, 5, 6, 7)), ((1, 90, 1), (30, 5, 7))],
}
BATCH, TOKENS, PAGES = 8, 128, 96


def _build(kind):
    ws = lambda: torch.empty(128 << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
    cuda = torch.device("cuda")
    if kind == "prefill":
        return FlashInferPrefillWrapper(ws(), HKV * GQA, HKV, D, PS, batch_size=4, max_total_tokens=TOKENS,
                                        max_num_pages=PAGES, device=cuda, accelerator_graph=True)
    if kind == "decode":
        return FlashInferDecodeWrapper(ws(), HKV * GQA, HKV, D, PS, batch_size=BATCH, max_num_pages=PAGES,
                                       device=cuda, accelerator_graph=True)
    return FlashInferMixedWrapper(ws(), ws(), HKV * GQA, HKV, D, PS, BATCH, TOKENS, PAGES, 2, cuda)


def _plan(w, kind, d, on_device=False):
    # on_device: kv_indices on the GPU, as the paged KV manager passes them (the padding rows'
    # sink entries are then written on the device too)
    idx = d.kv_indices.cuda() if on_device else d.kv_indices
    if kind == "decode":
        w.plan(d.kv_indptr, idx, d.last_page_len, dtype=BF16, kv_lens=d.kv_lens)
    else:
        w.plan(d.qo_indptr, d.kv_indptr, idx, d.last_page_len, causal=True, dtype=BF16, kv_lens=d.kv_lens)


@pytest.mark.parametrize("kind,on_device", [("prefill", False), ("decode", False), ("mixed", False),
                                            ("prefill", True), ("decode", True)])
def test_graph_replay_with_fresh_plans(real_flashinfer, kind, on_device):
    w = _build(kind)
    rows_static = BATCH if kind == "decode" else TOKENS
    q_static = torch.randn(rows_static, HKV * GQA, D, device="cuda", dtype=BF16)
    layer = torch.randn(PAGES + 1, 2, PS, HKV, D, device="cuda", dtype=BF16)
    cases = [C.PagedCase(PS, D, GQA, q, p, num_kv_heads=HKV, seed=900 + i) for i, (q, p) in enumerate(GRAPH_STEPS[kind])]
    datas = [C.make_paged(c, "cuda", BF16) for c in cases]
    _plan(w, kind, datas[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graphs asks
        w.run(q_static, layer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = w.run(q_static, layer)
    for c, d in zip(cases, datas):
        n = d.q.shape[0]
        layer.zero_()
        layer[: d.layer.shape[0]].copy_(d.layer)
        q_static.normal_()
        q_static[:n].copy_(d.q)
        out_static.fill_(float("nan"))  # poison: a replay that skips rows shows
        _plan(w, kind, d, on_device)
        graph.replay()
        torch.cuda.synchronize()
        from mstar_core.testing.oracle import rel_error
        e = rel_error(out_static[:n], C.paged_oracle(c, d, True))
        assert e <= C.TOLERANCE[BF16], f"{kind} replay [{c}]: relative error {e:.3g}"


# -- the stand-in keeps the real signatures ------------------------------------------------------

NAMES = ["BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper",
         "BatchPrefillWithRaggedKVCacheWrapper"]


def _params(fn):
    return [(p.name, p.kind, p.default if p.default is not inspect.Parameter.empty else "<required>")
            for p in inspect.signature(fn).parameters.values()]


# The parameters this plugin passes, by keyword or position: on a release other than the stand-in's
# base (0.5.3) they must all still exist with the same name (0.7 added parameters; the stand-in
# models 0.7's behaviour, not its full signatures).
PLUGIN_USES = {
    ("BatchPrefillWithPagedKVCacheWrapper", "__init__"): (
        "float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf", "paged_kv_indptr_buf",
        "paged_kv_indices_buf", "paged_kv_last_page_len_buf", "backend"),
    ("BatchPrefillWithPagedKVCacheWrapper", "plan"): (
        "qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads", "num_kv_heads",
        "head_dim_qk", "page_size", "causal", "window_left", "non_blocking", "seq_lens", "sm_scale", "logits_soft_cap",
        "q_data_type", "kv_data_type"),
    ("BatchPrefillWithPagedKVCacheWrapper", "run"): ("q", "paged_kv_cache", "out"),
    ("BatchDecodeWithPagedKVCacheWrapper", "__init__"): (
        "float_workspace_buffer", "kv_layout", "use_cuda_graph", "use_tensor_cores", "paged_kv_indptr_buffer",
        "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer", "backend"),
    ("BatchDecodeWithPagedKVCacheWrapper", "plan"): (
        "indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "window_left",
        "non_blocking", "seq_lens", "sm_scale", "logits_soft_cap", "q_data_type", "kv_data_type"),
    ("BatchDecodeWithPagedKVCacheWrapper", "run"): ("q", "paged_kv_cache", "out"),
    ("BatchPrefillWithRaggedKVCacheWrapper", "__init__"): ("float_workspace_buffer", "kv_layout", "backend"),
    ("BatchPrefillWithRaggedKVCacheWrapper", "plan"): (
        "qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk", "causal", "window_left", "sm_scale",
        "q_data_type", "kv_data_type", "non_blocking"),
    ("BatchPrefillWithRaggedKVCacheWrapper", "run"): ("q", "k", "v"),
}


def _accepted(cls, meth):
    names = set(inspect.signature(getattr(cls, meth)).parameters)
    impl = getattr(cls, "_plan_impl", None) if meth == "plan" else None
    if impl is not None:  # 0.7 decode: plan(..., *deprecated_positional_args, **kwargs) -> _plan_impl(*, ...)
        names |= set(inspect.signature(impl).parameters)
    return names


@pytest.mark.parametrize("name", NAMES)
def test_standin_signatures_match_real(real_flashinfer, monkeypatch, name):
    real = getattr(real_flashinfer, name)
    saved = {n: m for n, m in sys.modules.items() if n == "flashinfer" or n.startswith("flashinfer.")}
    from pathlib import Path
    for n in saved:
        monkeypatch.delitem(sys.modules, n)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "standins"))
    standin = importlib.import_module("flashinfer")
    stand = getattr(standin, name)
    try:
        for meth in ("__init__", "plan", "run"):
            if real_flashinfer.__version__ == standin.__version__:
                assert _params(getattr(stand, meth)) == _params(getattr(real, meth)), f"{name}.{meth}"
            else:
                missing = set(PLUGIN_USES[name, meth]) - _accepted(real, meth)
                assert not missing, f"flashinfer {real_flashinfer.__version__} {name}.{meth} lacks {sorted(missing)}"
                assert set(PLUGIN_USES[name, meth]) <= _accepted(stand, meth), f"stand-in {name}.{meth}"
    finally:
        for n in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
            del sys.modules[n]
