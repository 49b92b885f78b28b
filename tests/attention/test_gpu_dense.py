"""On the GPU: the dense path through the real FA3 (``flash_attn_interface``) and FlashInfer's
ragged prefill, against the float64 reference in bf16 — the wrappers through the conformance
suite's ragged cases, the DenseAttentionManager end to end with the KVManager — and the CPU
stand-ins against the real kernels on the same inputs. Errors go to
``$OUT/dense_gpu_conformance.json`` when ``OUT`` is set.

    source .gpu/env.sh fa3 ... ; source .gpu/env.sh flashinfer
    python3 -m pytest -m gpu tests/attention/test_gpu_dense.py
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from mstar_core import DenseAttentionManager
from mstar_core.testing import conformance as C

from ..helpers import STANDINS, Harness, fa3_feature_cases, write_results

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
RESULTS: list[dict] = []


def _real(module: str):
    """The real library, never a stand-in (those are only ever put in sys.modules by fixtures)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here")
    mod = importlib.import_module(module)
    assert not getattr(mod, "STANDIN", False), f"{module} resolved to a stand-in"
    return mod


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    write_results("dense_gpu_conformance", RESULTS, ("tokenspeed-fa3", "flashinfer-python"))


def fa3_cls():
    _real("flash_attn_interface")
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

    return FA3PrefixedPrefillWrapper


def flashinfer_cls():
    _real("flashinfer")
    from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

    return FlashInferPrefixedPrefillWrapper


WRAPPERS = {"fa3": fa3_cls, "flashinfer": flashinfer_cls}
# FlashInfer compiles a module per head_dim on first use: keep its cases to the carried bf16/128 set.
CASES = {
    "fa3": C.ragged_cases(),
    "flashinfer": C.ragged_cases(head_dims=(128,)),
}


@pytest.mark.parametrize("name,case", [(n, c) for n in WRAPPERS for c in CASES[n]],
                         ids=[f"{n}-{c}" for n in WRAPPERS for c in CASES[n]])
def test_ragged_conformance(name, case):
    cls = WRAPPERS[name]()
    err = C.check_ragged(C.WrapperSet(name, ragged=cls, device="cuda", dtype=BF16, workspace_bytes=128 << 20), case)
    RESULTS.append({"test": "ragged", "backend": name, "case": str(case), "rel_error": err})


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_dense_manager_end_to_end(name):
    cls = WRAPPERS[name]()
    h = Harness(lambda kv, cfg: DenseAttentionManager(kv, kv.device, kv.dtype, cfg, cls), BF16,
                layers=2, hkv=8, hq=32, d=128, page_size=16, max_pages=256, device="cuda")
    h.ingest("a", "b", "c")
    errs = [h.step([("a", 256, True), ("b", 100, True)], causal=False)[0]]
    for _ in range(3):
        errs.append(h.step([("a", 300, False), ("b", 77, False), ("c", 40, False)])[0])
    h.reset("b")
    errs.append(h.step([("b", 64, True)], causal=True)[0])
    errs.append(h.step([("a", 300, False), ("b", 77, False), ("c", 40, False)])[0])
    RESULTS.append({"test": "dense_manager", "backend": name, "rel_errors": errs,
                    "gathers": h.attn.stats.gathers, "hits": h.attn.stats.hits})
    assert max(errs) < C.TOLERANCE[BF16], errs
    assert h.attn.stats.gathers == 3 * 2 and h.attn.stats.hits > 0


def _load_standin(monkeypatch, name):
    path = STANDINS / name / "__init__.py"
    spec = importlib.util.spec_from_file_location(f"_standin_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fa3_standin_matches_the_real_kernel(monkeypatch):
    """The stand-in computes what the real flash_attn_varlen_func computes, on the same inputs,
    under the same arguments (causal prefix, window, scale) and return convention."""
    real = _real("flash_attn_interface")
    fake = _load_standin(monkeypatch, "flash_attn_interface")
    g = torch.Generator().manual_seed(5)
    q_lens, k_lens = (7, 33, 1), (20, 33, 9)
    q = torch.randn(sum(q_lens), 8, 128, generator=g).to("cuda", BF16)
    k = torch.randn(sum(k_lens), 2, 128, generator=g).to("cuda", BF16)
    v = torch.randn(sum(k_lens), 2, 128, generator=g).to("cuda", BF16)
    cu_q = torch.tensor([0, 7, 40, 41], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 20, 53, 62], dtype=torch.int32, device="cuda")
    for kw in ({"causal": True}, {"causal": False}, {"causal": True, "window_size": (5, 0), "softmax_scale": 0.05}):
        a = real.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 33, **kw)
        b = fake.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 33, **kw)
        assert type(a) is type(b), "return convention differs from the real build"
        a = a[0] if isinstance(a, tuple) else a
        b = b[0] if isinstance(b, tuple) else b
        err = float((a.float() - b.float()).norm() / b.float().norm())
        RESULTS.append({"test": "fa3_standin_vs_real", "kwargs": str(kw), "rel_error": err})
        assert err < 1e-2, (kw, err)


# -- attention features --------------------------------------------------------------------------

@pytest.mark.parametrize("case", fa3_feature_cases(), ids=str)
def test_fa3_feature_conformance(case):
    """Every feature FA3 declares (sink logits, windows) against the float64 oracle."""
    cls = fa3_cls()
    err = C.check_ragged(C.WrapperSet("fa3", ragged=cls, device="cuda", dtype=BF16, workspace_bytes=1 << 20), case)
    RESULTS.append({"test": "ragged_features", "backend": "fa3", "case": str(case), "rel_error": err})


def test_fa3_build_softcap_matches_the_declaration():
    """The plugin declares soft_cap only if the installed build computes it: call the real kernel
    with softcap and record what it does (the declaration must agree)."""
    fa3 = _real("flash_attn_interface")
    from mstar_fa3.plugin import FA3

    q = torch.randn(16, 4, 128, device="cuda", dtype=BF16)
    k = torch.randn(16, 2, 128, device="cuda", dtype=BF16)
    cu = torch.tensor([0, 16], dtype=torch.int32, device="cuda")
    try:
        fa3.flash_attn_varlen_func(q, k, k, cu, cu, 16, 16, causal=True, softcap=30.0)
        supported, why = True, "ran"
    except RuntimeError as e:
        supported, why = False, str(e)
    RESULTS.append({"test": "fa3_softcap_probe", "softcap_runs": supported, "message": why})
    assert ("soft_cap" in FA3.supports("prefixed_ragged")) == supported, why


@pytest.mark.parametrize("which", ["fa3", "flashinfer"])
def test_dense_manager_fp8_prefix_and_features(which):
    """The dense manager over an FP8 cache (the prefix dequantised once per stream and layer) with
    the features the backend declares, end to end against the oracle."""
    from mstar_core import AttentionFeatures

    cls = WRAPPERS[which]()
    extra = {"sink_logits": True, "layer_windows": (64, -1)} if which == "fa3" else \
        {"soft_cap": 30.0, "layer_windows": (64, -1)}
    f = AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=(0.5, 2.0), v_scale=0.5, **extra)
    h = Harness(lambda kv, cfg: DenseAttentionManager(kv, kv.device, kv.dtype, cfg, cls), BF16,
                layers=2, hkv=8, hq=32, d=128, page_size=16, max_pages=256, device="cuda", features=f)
    h.ingest("a", "b")
    errs = [h.step([("a", 256, True), ("b", 100, True)], causal=True)[0]]
    for _ in range(2):
        errs.append(h.step([("a", 300, False), ("b", 77, False)], causal=True)[0])
    RESULTS.append({"test": "dense_manager_fp8_features", "backend": which, "features": str(f), "rel_errors": errs})
    assert max(errs) < C.TOLERANCE[BF16], errs
    assert h.attn.stats.gathers == 2 * 2
