"""The ``flash_attn_interface`` stand-in (tests/standins/flash_attn_interface) on the attention
features, against the float64 oracle and the real tokenspeed-fa3 3.0.0 build's contract:

- ``window_size=(left, right)``, bottom-right aligned;
- ``softcap``: that build is compiled without soft-cap (``FLASHATTENTION_DISABLE_SOFTCAP``), so
  any non-zero ``softcap`` is a RuntimeError there and here; a build with soft-cap
  (``SOFTCAP_BUILD = True``) gives ``softcap * tanh(scaled score / softcap)``;
- ``sinks``: a bfloat16 ``[num_heads_q]`` logit per query head added to each softmax
  denominator; the build refuses any other dtype/shape, and non-contiguous sinks."""

from __future__ import annotations

import inspect

import pytest
import torch

from mstar_core.testing.oracle import attention_oracle, rel_error

HQ, HKV, D = 4, 2, 32

# flash_attn_interface.py (tokenspeed-fa3 3.0.0): flash_attn_varlen_func's parameters, in order
REAL_PARAMETERS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("cu_seqlens_q", inspect.Parameter.empty), ("cu_seqlens_k", inspect.Parameter.empty),
    ("max_seqlen_q", inspect.Parameter.empty), ("max_seqlen_k", inspect.Parameter.empty),
    ("seqused_q", None), ("seqused_k", None), ("softmax_scale", None), ("causal", False), ("qv", None),
    ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
    ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
    ("sm_margin", 0), ("return_attn_probs", False), ("sinks", None),
]


def _data(q_lens, k_lens, seed=0, q_mag=2.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(sum(q_lens), HQ, D, generator=g) * q_mag).to(dtype)
    k = torch.randn(sum(k_lens), HKV, D, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), HKV, D, generator=g).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k, max(q_lens), max(k_lens)


def _oracle(q, k, v, cu_q, cu_k, causal, window_left=-1, scale=None, soft_cap=None, sinks=None):
    return torch.cat([
        attention_oracle(q[a:b], k[c:e], v[c:e], causal, window_left, scale, soft_cap=soft_cap, sinks=sinks)
        for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(),
                              strict=True)])


def _sinks(seed=1):
    return (torch.randn(HQ, generator=torch.Generator().manual_seed(seed)) * 2 + 1).to(torch.bfloat16)


CASES = [([3, 1, 5], [7, 4, 5]), ([1, 1], [9, 1]), ([6], [6])]


def test_signature_is_the_real_one(fa3_standin):
    params = inspect.signature(fa3_standin.flash_attn_varlen_func).parameters
    assert [(n, p.default) for n, p in params.items()] == REAL_PARAMETERS
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


@pytest.mark.parametrize("softcap", [30.0, 1.0, -1.0])
def test_this_build_refuses_softcap(fa3_standin, softcap):
    q, k, v, cu_q, cu_k, mq, mk = _data([2], [3])
    with pytest.raises(RuntimeError, match="This flash attention build does not support tanh softcapping."):
        fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, softcap=softcap)
    fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, softcap=0.0)


@pytest.mark.parametrize("q_lens,k_lens", CASES)
@pytest.mark.parametrize("causal,window", [(True, -1), (True, 3), (False, -1), (False, 2)])
def test_softcap_in_a_build_with_softcap(fa3_standin, q_lens, k_lens, causal, window):
    fa3_standin.SOFTCAP_BUILD = True
    q, k, v, cu_q, cu_k, mq, mk = _data(q_lens, k_lens)
    win = (window, 0 if causal else -1) if window >= 0 else (-1, -1)
    out = fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.5, causal=causal,
                                             window_size=win, softcap=1.5)
    ref = _oracle(q, k, v, cu_q, cu_k, causal, window, 0.5, soft_cap=1.5)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, ref) < 1e-2
    assert rel_error(_oracle(q, k, v, cu_q, cu_k, causal, window, 0.5), ref) > 5e-2  # the cap matters
    # a non-positive softcap is off in such a build (Has_softcap = softcap > 0)
    plain = fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.5, causal=causal,
                                               window_size=win, softcap=-2.0)
    assert rel_error(plain, _oracle(q, k, v, cu_q, cu_k, causal, window, 0.5)) < 1e-2


@pytest.mark.parametrize("q_lens,k_lens", CASES)
@pytest.mark.parametrize("causal,window", [(True, -1), (True, 2), (False, -1)])
def test_sinks_join_each_softmax_denominator(fa3_standin, q_lens, k_lens, causal, window):
    q, k, v, cu_q, cu_k, mq, mk = _data(q_lens, k_lens)
    sinks = _sinks()
    win = (window, 0 if causal else -1) if window >= 0 else (-1, -1)
    out, lse = fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window_size=win,
                                                  sinks=sinks, return_attn_probs=True)
    ref = _oracle(q, k, v, cu_q, cu_k, causal, window, sinks=sinks)
    assert rel_error(out, ref) < 1e-2
    assert rel_error(_oracle(q, k, v, cu_q, cu_k, causal, window), ref) > 5e-2  # the sinks matter
    # the lse is the softmax denominator's, the sink included
    for i, (a, b, c, e) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                                         cu_k[1:].tolist(), strict=True)):
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[c:e].double().repeat_interleave(HQ // HKV, 1))
        s = s / D ** 0.5
        pos = torch.arange(b - a)[:, None] + (e - c) - (b - a)
        j = torch.arange(e - c)[None, :]
        ok = j <= pos if causal else torch.ones_like(j <= pos)
        if window >= 0:
            ok &= j >= pos - window
        s = s.masked_fill(~ok, float("-inf"))
        want = torch.logsumexp(torch.cat([s, sinks.double()[:, None, None].expand(HQ, b - a, 1)], -1), -1)
        assert torch.allclose(lse[:, a:b].double(), want, atol=1e-3), i


def test_sinks_with_softcap_in_a_build_with_softcap(fa3_standin):
    fa3_standin.SOFTCAP_BUILD = True
    q, k, v, cu_q, cu_k, mq, mk = _data([3, 4], [6, 4])
    sinks = _sinks(2)
    out = fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, softcap=2.0, sinks=sinks)
    assert rel_error(out, _oracle(q, k, v, cu_q, cu_k, True, soft_cap=2.0, sinks=sinks)) < 1e-2


def test_sinks_for_a_query_that_sees_no_key(fa3_standin):
    """Causal with more queries than keys: the first queries see no key and get zeros, as
    without sinks (their lse is then the sink alone); an empty segment stays empty."""
    q, k, v, cu_q, cu_k, mq, mk = _data([3], [1])
    sinks = _sinks()
    out, lse = fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, sinks=sinks,
                                                  return_attn_probs=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.allclose(lse[:, :2], sinks.float()[:, None].expand(HQ, 2))
    assert rel_error(out, _oracle(q, k, v, cu_q, cu_k, True, sinks=sinks)) < 1e-2
    q0, k0, v0, _, _, _, _ = _data([1], [3])
    cu_q0 = torch.tensor([0, 0, 1], dtype=torch.int32)
    cu_k0 = torch.tensor([0, 1, 3], dtype=torch.int32)
    out0 = fa3_standin.flash_attn_varlen_func(q0, k0, v0, cu_q0, cu_k0, 1, 2, causal=True, sinks=sinks)
    assert rel_error(out0, attention_oracle(q0, k0[1:3], v0[1:3], True, sinks=sinks)) < 1e-2


@pytest.mark.parametrize("bad,match", [
    (lambda s: s.float(), "sinks must have dtype bfloat16"),
    (lambda s: s.half(), "sinks must have dtype bfloat16"),
    (lambda s: s[:HKV].contiguous(), f"sinks dimension 0 must have size {HQ}, got {HKV}"),
    (lambda s: s[None], "sinks must have 1 dimensions, got 2"),
    (lambda s: torch.stack([s, s], 1)[:, 0], "sinks must be contiguous"),
])
def test_sinks_checks_of_the_build(fa3_standin, bad, match):
    q, k, v, cu_q, cu_k, mq, mk = _data([2], [3])
    with pytest.raises(RuntimeError, match=match):
        fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, sinks=bad(_sinks()))


def test_window_left_and_right(fa3_standin):
    q, k, v, cu_q, cu_k, mq, mk = _data([4, 3], [9, 3])
    out = fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=(2, -1))
    assert rel_error(out, _oracle(q, k, v, cu_q, cu_k, False, 2)) < 1e-2
    # (left, 0) is causal with a window; causal=True caps right at 0 whatever it is
    a = fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=(2, 0))
    b = fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, window_size=(2, 5))
    assert torch.equal(a, b)
    assert rel_error(a, _oracle(q, k, v, cu_q, cu_k, True, 2)) < 1e-2


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_descales_are_refused_not_ignored(fa3_standin, name):
    q, k, v, cu_q, cu_k, mq, mk = _data([2], [3])
    with pytest.raises(NotImplementedError, match=name):
        fa3_standin.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **{name: torch.ones(1, HKV)})
