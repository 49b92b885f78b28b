"""The conformance suite's ragged cases through the FA3 and AITER wrappers (over their
stand-ins, on CPU) and the reference, plus what the suite does not cover: windows, an explicit
scale, both FA3 return conventions, and the wrappers' errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from mstar_core.backends.reference import ReferencePrefixedPrefillWrapper
from mstar_core.testing import check as K
from mstar_core.testing import conformance as C
from mstar_core.testing.oracle import attention_oracle, rel_error

from ..helpers import fa3_feature_cases

CASES = C.ragged_cases()
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="f16")]


def fa3_set(dtype):
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

    return C.WrapperSet("fa3", ragged=FA3PrefixedPrefillWrapper, dtype=dtype)


def aiter_set(dtype):
    from mstar_rocm.ragged import AiterPrefixedPrefillWrapper

    return C.WrapperSet("aiter", ragged=AiterPrefixedPrefillWrapper, dtype=dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fa3_ragged(case, dtype, fa3_standin_both):
    calls = fa3_standin_both.CALLS
    C.check_ragged(fa3_set(dtype), case)
    assert fa3_standin_both.CALLS == calls + 1  # the stand-in, not some fallback, computed it


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_aiter_ragged(case, dtype, aiter_standin):
    calls = aiter_standin.CALLS
    C.check_ragged(aiter_set(dtype), case)
    assert aiter_standin.CALLS == calls + 1


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")])
@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_reference_ragged(case, dtype):
    C.check_ragged(C.WrapperSet("reference", ragged=ReferencePrefixedPrefillWrapper, dtype=dtype), case)


def _window_case(wrapper_cls, dtype, causal, window_left, sm_scale):
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 8, 2, 64
    q_lens, p_lens = (5, 12, 1), (9, 0, 20)
    k_lens = [a + b for a, b in zip(q_lens, p_lens, strict=True)]
    q = torch.randn((sum(q_lens), hq, d), generator=gen).to(dtype)
    k = torch.randn((sum(k_lens), hkv, d), generator=gen).to(dtype)
    v = torch.randn((sum(k_lens), hkv, d), generator=gen).to(dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
    w = wrapper_cls(hq, hkv, d, torch.device("cpu"))
    w.plan(cu_q, cu_k, max(q_lens), max(k_lens), causal=causal, dtype=dtype, sm_scale=sm_scale, window_left=window_left)
    out = w.run(q, k, v)
    ref = torch.cat([
        attention_oracle(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]], causal, window_left,
                         sm_scale)
        for i in range(len(q_lens))
    ])
    return rel_error(out, ref)


@pytest.mark.parametrize("causal,window_left,sm_scale", [(True, 4, None), (False, 3, None), (True, -1, 0.05)],
                         ids=["causal-win4", "full-win3", "causal-scale"])
def test_window_and_scale(causal, window_left, sm_scale, fa3_standin, aiter_standin):
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper
    from mstar_rocm.ragged import AiterPrefixedPrefillWrapper

    for cls in (FA3PrefixedPrefillWrapper, AiterPrefixedPrefillWrapper):
        assert _window_case(cls, torch.bfloat16, causal, window_left, sm_scale) < C.TOLERANCE[torch.bfloat16], cls
    assert _window_case(ReferencePrefixedPrefillWrapper, torch.float32, causal, window_left, sm_scale) < 2e-5


def test_fa3_plan_moves_indices_once(fa3_standin):
    """plan puts cu_q/cu_k on the device once; every run reuses the same tensors."""
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

    seen = []
    real = fa3_standin.flash_attn_varlen_func

    def spy(q, k, v, cu_q, cu_k, *a, **kw):
        seen.append((cu_q, cu_k))
        return real(q, k, v, cu_q, cu_k, *a, **kw)

    fa3_standin.flash_attn_varlen_func = spy
    w = FA3PrefixedPrefillWrapper(4, 2, 64, "cpu")
    w.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32), 3, 7, dtype=torch.bfloat16)
    q = torch.randn(3, 4, 64).bfloat16()
    k = torch.randn(7, 2, 64).bfloat16()
    for _ in range(3):
        w.run(q, k, k)
    assert len(seen) == 3 and all(a is seen[0][0] and b is seen[0][1] for a, b in seen)
    assert seen[0][0].dtype == torch.int32


@pytest.mark.parametrize("which", ["fa3", "aiter"])
def test_wrapper_errors(which, fa3_standin, aiter_standin):
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper
    from mstar_rocm.ragged import AiterPrefixedPrefillWrapper

    cls = FA3PrefixedPrefillWrapper if which == "fa3" else AiterPrefixedPrefillWrapper
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cls(6, 4, 64, "cpu")
    w = cls(4, 2, 64, "cpu")
    q, k = torch.randn(3, 4, 64).bfloat16(), torch.randn(7, 2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, k, k)
    with pytest.raises(TypeError, match="dtypes"):
        w.plan(torch.tensor([0, 3]), torch.tensor([0, 7]), 3, 7, dtype=torch.float32)
    w.plan(torch.tensor([0, 3]), torch.tensor([0, 7]), 3, 7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"k has shape \(6, 2, 64\), expected \(7, 2, 64\)"):
        w.run(q, k[:6], k)
    with pytest.raises(TypeError, match="planned torch.bfloat16"):
        w.run(q.half(), k, k)


def test_standins_keep_the_real_contracts(fa3_standin, aiter_standin):
    """The stand-ins refuse what the real kernels refuse, so a wrapper that passes float32 or
    int64 offsets fails here and not first on the GPU."""
    q, k = torch.randn(3, 4, 64), torch.randn(7, 2, 64)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    for fn in (fa3_standin.flash_attn_varlen_func, aiter_standin.flash_attn_varlen_func):
        with pytest.raises(RuntimeError, match="dtype"):
            fn(q, k, k, cu_q, cu_k, 3, 7)
        with pytest.raises(RuntimeError, match="int32"):
            fn(q.bfloat16(), k.bfloat16(), k.bfloat16(), cu_q.long(), cu_k, 3, 7)
    # return conventions
    qb, kb = q.bfloat16(), k.bfloat16()
    assert isinstance(fa3_standin.flash_attn_varlen_func(qb, kb, kb, cu_q, cu_k, 3, 7), torch.Tensor)
    out, lse = fa3_standin.flash_attn_varlen_func(qb, kb, kb, cu_q, cu_k, 3, 7, return_attn_probs=True)
    assert lse.shape == (4, 3)
    assert isinstance(aiter_standin.flash_attn_varlen_func(qb, kb, kb, cu_q, cu_k, 3, 7), torch.Tensor)
    assert len(aiter_standin.flash_attn_varlen_func(qb, kb, kb, cu_q, cu_k, 3, 7, return_lse=True)) == 2


def test_plugin_modules_import_no_kernel_library(monkeypatch):
    """The wrapper modules import their kernel library only when a wrapper is built: with the
    libraries blocked (``import x`` raises) and the modules imported afresh, they still load."""
    import importlib
    import sys

    for mod in ("flash_attn_interface", "aiter", "flash_attn_3"):
        monkeypatch.setitem(sys.modules, mod, None)  # `import mod` now raises ImportError
    for mod in [m for m in sys.modules if m.split(".")[0] in ("mstar_fa3", "mstar_rocm")]:
        monkeypatch.delitem(sys.modules, mod)  # restored after the test
    fa3 = importlib.import_module("mstar_fa3.ragged")
    rocm = importlib.import_module("mstar_rocm.ragged")
    assert fa3.FA3PrefixedPrefillWrapper.module == "flash_attn_interface"
    assert rocm.AiterPrefixedPrefillWrapper.module == "aiter"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", fa3_feature_cases(), ids=str)
def test_fa3_ragged_features(case, dtype, fa3_standin):
    """Every feature FA3 declares (sink logits, windows), through the stand-in of the tested build
    (sinks taken as bfloat16 [Hq], as hopper's flash_api checks)."""
    C.check_ragged(fa3_set(dtype), case)


def test_fa3_declares_no_soft_cap_and_its_build_refuses_one(fa3_standin):
    """The declaration follows the tested build: soft-cap is compiled out of it."""
    from mstar_fa3.plugin import FA3

    assert "soft_cap" not in FA3.supports("prefixed_ragged")
    case = C.RaggedCase(64, 4, (3, 5), (2, 0), soft_cap=30.0)
    with pytest.raises(RuntimeError, match="does not support tanh softcapping"):
        C.check_ragged(fa3_set(torch.bfloat16), case)


# -- what `mstar check` adds, over the stand-ins: rows poisoned or seeing no key, re-planning


def _extra(spec, cls):
    return [c for c in K.plan_checks(spec, {"prefixed_ragged": cls}, "cpu", [torch.bfloat16], [128])
            if c.group in ("edge", "replan")]


def test_fa3_edge_rows_and_replanning(fa3_standin_both):
    from mstar_fa3.plugin import FA3
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

    checks = _extra(FA3, FA3PrefixedPrefillWrapper)
    assert {c.group for c in checks} == {"edge", "replan"}
    for c in checks:
        result = K.run_check(c)
        assert result.passed and not result.refused, (c.id, result.message)  # FA3 returns zeros: no refusal


def test_aiter_edge_rows_and_replanning(aiter_standin):
    from mstar_rocm.plugin import AITER as ROCM
    from mstar_rocm.ragged import AiterPrefixedPrefillWrapper

    for c in _extra(ROCM, AiterPrefixedPrefillWrapper):
        result = K.run_check(c)
        assert result.passed and not result.refused, (c.id, result.message)
