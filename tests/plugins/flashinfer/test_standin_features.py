"""The stand-in ``flashinfer`` (tests/standins/flashinfer) against the float64 oracle on the
attention features, with FlashInfer 0.5.3's semantics (decode.py / prefill.py ``plan``/``run``):

- ``logits_soft_cap``: ``cap * tanh(score / cap)`` after the scale; on only when ``> 0``;
- FP8 KV (e4m3/e5m2): the cache read as stored; ``q_scale``/``k_scale`` multiply ``sm_scale``,
  ``v_scale`` multiplies the output after the kernel (in place, in q's dtype); ``run`` checks the
  cache dtype against the plan's ``kv_data_type`` (ValueError);
- ``sinks``: 0.5.3 drops them silently on the fa2/fa3 paths, so the stand-in refuses them.

Every test runs on each emulated release (the ``standin_flashinfer`` fixture)."""

from __future__ import annotations

import math

import pytest
import torch

from mstar_core.testing.oracle import attention_oracle, rel_error

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
HQ, HKV, D, PAGE = 4, 2, 16, 4


def _ws():
    return torch.empty(1 << 20, dtype=torch.uint8)


def _paged(q_lens, kv_lens, *, dtype=torch.float32, kv_dtype=None, layout="NHD", seed=0, q_mag=1.0):
    """Random q and an NHD/HND paged cache ``[pages, 2, ...]`` whose pages are shuffled, plus
    the plan tensors and each row's K/V (as stored) for the oracle. Page 0 is unused and holds
    garbage."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    n_pages = [-(-n // PAGE) for n in kv_lens]
    total = sum(n_pages) + 1
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    q = (torch.randn(sum(q_lens), HQ, D, generator=g) * q_mag).to(dtype)
    cache = torch.randn(total, 2, PAGE, HKV, D, generator=g) * 2.0
    cache[0] = 1e4  # never read
    cache = cache.to(kv_dtype)
    indices, rows_kv, p = [], [], 0
    for n, kv in zip(n_pages, kv_lens, strict=True):
        pages = perm[p:p + n]
        p += n
        indices += pages
        rows_kv.append(cache[pages].transpose(0, 1).reshape(2, n * PAGE, HKV, D)[:, :kv])
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    indptr = torch.tensor([0, *torch.tensor(n_pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([kv - (n - 1) * PAGE for n, kv in zip(n_pages, kv_lens, strict=True)], dtype=torch.int32)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    return q, cache, qo, indptr, torch.tensor(indices, dtype=torch.int32), last, rows_kv


def _oracle(q, qo, rows_kv, *, causal, window_left=-1, sm_scale=None, soft_cap=None, k_scale=1.0, v_scale=1.0):
    """The oracle per row over the dequantised K/V (``stored.double() * scale``)."""
    outs = []
    for i, (k, v) in enumerate(rows_kv):
        a, b = int(qo[i]), int(qo[i + 1])
        outs.append(attention_oracle(q[a:b], k.double() * k_scale, v.double() * v_scale, causal, window_left,
                                     sm_scale, soft_cap=soft_cap))
    return torch.cat(outs)


def _prefill(fi, q, cache, qo, indptr, indices, last, *, causal=True, layout="NHD", kv_dtype=None, backend="auto",
             **plan):
    w = fi.BatchPrefillWithPagedKVCacheWrapper(_ws(), layout, backend=backend)
    w.plan(qo, indptr, indices, last, HQ, HKV, D, PAGE, causal=causal, q_data_type=q.dtype,
           kv_data_type=kv_dtype if kv_dtype is not None else cache.dtype, **plan)
    return w


def _decode(fi, q, cache, indptr, indices, last, *, tensor_cores=False, layout="NHD", **plan):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_ws(), layout, use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=q.dtype, kv_data_type=cache.dtype, **plan)
    return w


# --------------------------------------------------------------------------------------------- soft-cap


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("window_left", [-1, 5])
def test_paged_prefill_soft_cap_is_cap_tanh_of_the_scaled_score(standin_flashinfer, layout, window_left):
    q_lens, kv_lens = [3, 1, 6], [9, 4, 6]
    q, cache, qo, indptr, indices, last, rows = _paged(q_lens, kv_lens, layout=layout, q_mag=3.0)
    cap, scale = 2.5, 0.4
    w = _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last, layout=layout, logits_soft_cap=cap,
                 sm_scale=scale, window_left=window_left)
    out = w.run(q, cache)
    ref = _oracle(q, qo, rows, causal=True, window_left=window_left, sm_scale=scale, soft_cap=cap)
    assert rel_error(out, ref) < 2e-5
    uncapped = _oracle(q, qo, rows, causal=True, window_left=window_left, sm_scale=scale)
    assert rel_error(uncapped, ref) > 1e-2  # the cap matters in this case


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_decode_soft_cap(standin_flashinfer, tensor_cores):
    kv_lens = [7, 1, 12]
    q, cache, _, indptr, indices, last, rows = _paged([1, 1, 1], kv_lens, q_mag=3.0)
    w = _decode(standin_flashinfer, q, cache, indptr, indices, last, tensor_cores=tensor_cores, logits_soft_cap=1.5)
    out = w.run(q, cache)
    ref = _oracle(q, torch.arange(4), rows, causal=False, soft_cap=1.5)
    assert rel_error(out, ref) < 2e-5
    assert rel_error(_oracle(q, torch.arange(4), rows, causal=False), ref) > 1e-2


def test_ragged_prefill_soft_cap(standin_flashinfer):
    g = torch.Generator().manual_seed(3)
    q_lens, kv_lens = [2, 5], [6, 5]
    q = torch.randn(sum(q_lens), HQ, D, generator=g) * 3
    k = torch.randn(sum(kv_lens), HKV, D, generator=g)
    v = torch.randn(sum(kv_lens), HKV, D, generator=g)
    qo = torch.tensor([0, 2, 7], dtype=torch.int32)
    kvp = torch.tensor([0, 6, 11], dtype=torch.int32)
    w = standin_flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo, kvp, HQ, HKV, D, causal=True, logits_soft_cap=2.0, q_data_type=torch.float32)
    out = w.run(q, k, v)
    ref = torch.cat([attention_oracle(q[0:2], k[0:6], v[0:6], True, soft_cap=2.0),
                     attention_oracle(q[2:7], k[6:11], v[6:11], True, soft_cap=2.0)])
    assert rel_error(out, ref) < 2e-5


@pytest.mark.parametrize("cap", [None, 0.0, -3.0])
def test_a_cap_that_is_not_positive_is_off(standin_flashinfer, cap):
    """0.5.3 builds the module with ``use_logits_soft_cap = logits_soft_cap > 0`` (None is 0.0)."""
    q, cache, qo, indptr, indices, last, rows = _paged([2, 3], [5, 3], q_mag=3.0)
    w = _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last, logits_soft_cap=cap)
    assert rel_error(w.run(q, cache), _oracle(q, qo, rows, causal=True)) < 2e-5
    jit = standin_flashinfer.jit.env.FLASHINFER_JIT_DIR
    assert [p.name for p in jit.iterdir() if "use_logits_cap_True" in p.name] == []
    _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last, logits_soft_cap=30.0)
    assert [p.name for p in jit.iterdir() if "use_logits_cap_True" in p.name]


# --------------------------------------------------------------------------------------------- FP8 KV


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("qdt", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_fp8_paged_prefill_reads_stored_times_scales(standin_flashinfer, kv_dtype, qdt):
    q, cache, qo, indptr, indices, last, rows = _paged([3, 4], [8, 5], dtype=qdt, kv_dtype=kv_dtype, q_mag=2.0)
    assert cache.dtype == kv_dtype
    k_scale, v_scale = 0.37, 1.9
    w = _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last, logits_soft_cap=4.0)
    out = w.run(q, cache, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == qdt
    ref = _oracle(q, qo, rows, causal=True, soft_cap=4.0, k_scale=k_scale, v_scale=v_scale)
    assert rel_error(out, ref) < 1e-2
    # the scales are not ignored
    assert rel_error(_oracle(q, qo, rows, causal=True, soft_cap=4.0), ref) > 5e-2


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_decode_reads_stored_times_scales(standin_flashinfer, kv_dtype, tensor_cores, layout):
    q, cache, _, indptr, indices, last, rows = _paged([1, 1, 1], [9, 2, 13], dtype=torch.bfloat16,
                                                      kv_dtype=kv_dtype, layout=layout, q_mag=2.0)
    w = _decode(standin_flashinfer, q, cache, indptr, indices, last, tensor_cores=tensor_cores, layout=layout,
                logits_soft_cap=3.0, window_left=4)
    out = w.run(q, cache, k_scale=0.5, v_scale=0.25)
    ref = _oracle(q, torch.arange(4), rows, causal=False, window_left=4, soft_cap=3.0, k_scale=0.5, v_scale=0.25)
    assert rel_error(out, ref) < 1e-2


def test_scales_follow_the_real_arithmetic_exactly(standin_flashinfer):
    """``k_scale`` and ``q_scale`` are folded into ``sm_scale`` (the kernel sees one scale), and
    ``v_scale`` multiplies the finished output in q's dtype, in place in a given ``out``."""
    q, cache, qo, indptr, indices, last, _ = _paged([2, 3], [6, 7], dtype=torch.bfloat16,
                                                    kv_dtype=torch.float8_e4m3fn, q_mag=2.0)
    base = 0.3
    w = _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last, sm_scale=base, logits_soft_cap=2.0)
    folded = _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last, sm_scale=base * 0.5 * 0.8,
                      logits_soft_cap=2.0)
    plain = folded.run(q, cache)
    assert torch.equal(w.run(q, cache, q_scale=0.5, k_scale=0.8), plain)
    buf = torch.empty_like(q)
    got = w.run(q, cache, q_scale=0.5, k_scale=0.8, v_scale=3.0, out=buf)
    assert got is buf
    assert torch.equal(got, plain * 3.0)  # bf16 output, then *= v_scale in bf16
    d = _decode(standin_flashinfer, q[:2], cache, indptr, indices, last, sm_scale=base)
    assert torch.equal(d.run(q[:2], cache, k_scale=0.8, v_scale=2.0),
                       _decode(standin_flashinfer, q[:2], cache, indptr, indices, last,
                               sm_scale=base * 0.8).run(q[:2], cache) * 2.0)


def test_default_sm_scale_is_scaled_too(standin_flashinfer):
    q, cache, qo, indptr, indices, last, rows = _paged([3], [5], dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2)
    w = _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last)
    ref = _oracle(q, qo, rows, causal=True, sm_scale=1 / math.sqrt(D), k_scale=2.0)
    assert rel_error(w.run(q, cache, k_scale=2.0), ref) < 1e-2


@pytest.mark.parametrize("kind", ["prefill", "decode", "decode_tc"])
def test_run_checks_the_cache_dtype_against_the_plan(standin_flashinfer, kind):
    q, cache, qo, indptr, indices, last, _ = _paged([1, 1], [5, 3], dtype=torch.bfloat16,
                                                    kv_dtype=torch.float8_e4m3fn)
    if kind == "prefill":
        w = _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last)
    else:
        w = _decode(standin_flashinfer, q, cache, indptr, indices, last, tensor_cores=kind == "decode_tc")
    w.run(q, cache)
    for wrong in (cache.to(torch.bfloat16), cache.view(torch.uint8).view(torch.float8_e5m2)):
        with pytest.raises(ValueError, match=f"The dtype of k {wrong.dtype} does not match the kv_data_type "
                                             r"torch.float8_e4m3fn specified in plan function"):
            w.run(q, wrong)
    with pytest.raises(ValueError, match="does not match the q_data_type"):
        w.run(q.half(), cache)


def test_fp8_names_the_module_as_flashinfer_does(standin_flashinfer):
    q, cache, qo, indptr, indices, last, _ = _paged([2], [5], dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2)
    _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last, logits_soft_cap=10.0)
    names = [p.name for p in standin_flashinfer.jit.env.FLASHINFER_JIT_DIR.iterdir()]
    assert any("dtype_q_bf16_dtype_kv_e5m2_dtype_o_bf16" in n and "use_logits_cap_True" in n for n in names), names


def test_fp8_queries_are_refused_on_fa2_as_flashinfer_does(standin_flashinfer):
    q, cache, qo, indptr, indices, last, _ = _paged([2], [5], kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match="fp8 tensor core is not supported in fa2 backend"):
        _prefill(standin_flashinfer, q.to(torch.float8_e4m3fn), cache, qo, indptr, indices, last, backend="fa2")


# --------------------------------------------------------------------------------------------- sinks


@pytest.mark.parametrize("kind", ["prefill", "decode", "decode_tc"])
def test_sinks_are_refused_since_0_5_3_drops_them_off_trtllm_gen(standin_flashinfer, kind):
    q, cache, qo, indptr, indices, last, _ = _paged([1, 1], [5, 3])
    if kind == "prefill":
        w = _prefill(standin_flashinfer, q, cache, qo, indptr, indices, last)
    else:
        w = _decode(standin_flashinfer, q, cache, indptr, indices, last, tensor_cores=kind == "decode_tc")
    with pytest.raises(NotImplementedError, match="the real FlashInfer 0.5.3 ignores sinks on this backend"):
        w.run(q, cache, sinks=torch.zeros(HQ))
    w.run(q, cache, sinks=None)  # None is fine


def test_ragged_run_has_no_sinks_or_scales(standin_flashinfer):
    """0.5.3's ragged ``run(q, k, v, *args, out, lse, return_lse, enable_pdl)``: a keyword it
    lacks is a TypeError there too."""
    q, k = torch.randn(2, HQ, D), torch.randn(2, HKV, D)
    w = standin_flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), HQ, HKV, D,
           q_data_type=torch.float32)
    for kw in ("sinks", "k_scale", "v_scale"):
        with pytest.raises(TypeError):
            w.run(q, k, k, **{kw: torch.zeros(HQ) if kw == "sinks" else 1.0})
