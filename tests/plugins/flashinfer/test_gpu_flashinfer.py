"""On the GPU: the conformance suite against the real FlashInfer (0.5.3, 0.7.2.post1 and 0.7.4
verified) in bf16 (eager, and replayed from captured CUDA graphs with fresh plans between replays),
the same suite against the stand-in on the GPU, and the stand-in's signatures checked against the real library's.

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
from mstar_core.testing import reuse
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

from ...helpers import STANDINS

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


# -- CUDA graphs: capture once, replan and replay (mstar_core.testing.reuse, what `mstar check` runs)

@pytest.mark.parametrize("kind,on_device", [("prefill", False), ("decode", False), ("mixed", False),
                                            ("prefill", True), ("decode", True)])
def test_graph_replay_with_fresh_plans(real_flashinfer, kind, on_device):
    # on_device: kv_indices on the GPU, as the paged KV manager passes them (the padding rows'
    # sink entries are then written on the device too)
    assert reuse.check_replay(REAL_DEVICE_INDICES if on_device else REAL, kind) <= C.TOLERANCE[BF16]


# -- the stand-in keeps the real signatures ------------------------------------------------------

NAMES = ["BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper",
         "BatchPrefillWithRaggedKVCacheWrapper", "BatchAttentionWithAttentionSinkWrapper"]


def _params(fn):
    return [(p.name, p.kind, p.default if p.default is not inspect.Parameter.empty else "<required>")
            for p in inspect.signature(fn).parameters.values()]


# The parameters this plugin passes, by keyword or position: on a release other than the stand-in's
# base (0.5.3) they must all still exist with the same name (0.7 added parameters; the stand-in
# models 0.7's behaviour, not its full signatures).
PLUGIN_USES = {
    ("BatchPrefillWithPagedKVCacheWrapper", "__init__"): (
        "float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf", "paged_kv_indptr_buf",
        "paged_kv_indices_buf", "paged_kv_last_page_len_buf", "backend", "jit_args", "jit_kwargs"),
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
    # Not built by the plugin (mstar_flashinfer.sink_variant builds its variant under another module
    # name): the stand-in's copy shows the module-name problem, so its constructor must stay the real one.
    ("BatchAttentionWithAttentionSinkWrapper", "__init__"): (
        "float_workspace_buffer", "kv_layout", "use_cuda_graph", "qo_indptr_buf", "paged_kv_indptr_buf",
        "paged_kv_indices_buf", "paged_kv_last_page_len_buf", "backend", "q_data_type", "kv_data_type",
        "head_dim_qk", "head_dim_vo", "window_left"),
    ("BatchAttentionWithAttentionSinkWrapper", "plan"): (
        "qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads", "num_kv_heads",
        "head_dim_qk", "page_size", "causal", "window_left", "non_blocking", "seq_lens", "sm_scale", "q_data_type",
        "kv_data_type"),
    ("BatchAttentionWithAttentionSinkWrapper", "run"): ("q", "paged_kv_cache", "v_scale", "out"),
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
    for n in saved:
        monkeypatch.delitem(sys.modules, n)
    monkeypatch.syspath_prepend(str(STANDINS))
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
