"""Sink logits on the paged wrappers over the stand-in: a plan with ``sink_logits=True`` runs the
AttentionSink variant (eager and on graph-mode static buffers), a run never computes without its
sinks, the refused combinations say what runs, and the variant's module is named per head dim."""

import dataclasses

import pytest
import torch

from mstar_core.errors import InputError, StateError, Unsupported
from mstar_core.testing import conformance as C
from mstar_flashinfer import sink_variant
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper

from ...helpers import case, err

pytestmark = pytest.mark.usefixtures("standin_flashinfer")
WS = torch.empty(1024, dtype=torch.uint8)
F32 = torch.float32
CPU = torch.device("cpu")
HQ, HKV = 4, 2


def _sinks(c):
    return torch.randn(HQ, generator=torch.Generator().manual_seed(c.seed + 5)) * 2.0


def _ref(c, d, sinks):
    return C.paged_oracle(c, d, c.causal, sinks)


def _prefill(head_dim=16, **kw):
    return FlashInferPrefillWrapper(WS, HQ, HKV, head_dim, 4, device=CPU, **kw)


def _plan_prefill(w, d, c, **kw):
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, causal=c.causal, dtype=F32, kv_lens=d.kv_lens,
           window_left=c.window_left, **kw)


def _plan_decode(w, d, c, **kw):
    w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_lens=d.kv_lens, window_left=c.window_left,
           **kw)


# -- a run never computes without the sinks its plan asked for -------------------------------------

@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_sinks_without_sink_logits_in_the_plan_are_refused(kind):
    c = case((1, 1), (5, 9)) if kind == "decode" else case((3, 1), (4, 6))
    d = C.make_paged(c, "cpu", F32)
    if kind == "decode":
        w = FlashInferDecodeWrapper(WS, HQ, HKV, 16, 4, device=CPU)
        _plan_decode(w, d, c)
    elif kind == "mixed":
        w = FlashInferMixedWrapper(WS, WS, HQ, HKV, 16, 4, 2, 4, int(d.layer.shape[0]), 1, CPU)
        _plan_prefill(w, d, c)
    else:
        w = _prefill()
        _plan_prefill(w, d, c)
    with pytest.raises(StateError, match=r"sinks given, but the plan was made without sink_logits=True"):
        w.run(d.q, d.layer, sinks=_sinks(c))


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_sink_plan_refuses_a_run_without_sinks(kind):
    c = case((1, 1), (5, 9)) if kind == "decode" else case((3, 1), (4, 6))
    d = C.make_paged(c, "cpu", F32)
    if kind == "decode":
        w = FlashInferDecodeWrapper(WS, HQ, HKV, 16, 4, device=CPU)
        _plan_decode(w, d, c, sink_logits=True)
    else:
        w = _prefill()
        _plan_prefill(w, d, c, sink_logits=True)
    with pytest.raises(InputError, match=r"made with sink_logits=True, so run needs sinks \[num_qo_heads=4\]"):
        w.run(d.q, d.layer)
    with pytest.raises(InputError, match=r"sinks has shape \(3,\), expected \(4,\)"):
        w.run(d.q, d.layer, sinks=torch.zeros(3))


def test_replanning_switches_between_the_sink_variant_and_the_plain_kernel():
    c = case((3, 2), (4, 7))
    d = C.make_paged(c, "cpu", F32)
    s = _sinks(c)
    w = _prefill()
    for sinks in (s, None, s):
        _plan_prefill(w, d, c, **({"sink_logits": True} if sinks is not None else {}))
        assert err(w.run(d.q, d.layer, sinks=sinks), _ref(c, d, sinks)) < 2e-5
    assert len(w._sink_inners) == 1  # built once, reused


# -- what the sink variant computes ---------------------------------------------------------------

@pytest.mark.parametrize("window_left", [-1, 3])
def test_decode_rows_run_on_the_sink_variant_one_query_per_row(window_left):
    c = case((1, 1, 1), (5, 9, 0), window_left=window_left)
    d = C.make_paged(c, "cpu", F32)
    w = FlashInferDecodeWrapper(WS, HQ, HKV, 16, 4, device=CPU)
    _plan_decode(w, d, c, sink_logits=True)
    assert w._inner is not w._decode and w._inner._qo_indptr_buf.tolist() == [0, 1, 2, 3]
    s = _sinks(c)
    assert err(w.run(d.q, d.layer, sinks=s), _ref(c, d, s)) < 2e-5
    _plan_decode(w, d, c)  # and back to FlashInfer's decode kernel
    assert w._inner is w._decode and err(w.run(d.q, d.layer), _ref(c, d, None)) < 2e-5


def test_each_window_switch_gets_its_own_module():
    """The variant compiles "sliding window or not" in: a windowed plan after a full one builds a
    second module (the stand-in refuses a plan whose window its module was not built for)."""
    w = _prefill()
    for window in (-1, 3, -1, 5):
        c = case((3, 2), (6, 7), window_left=window, seed=window + 2)
        d = C.make_paged(c, "cpu", F32)
        _plan_prefill(w, d, c, sink_logits=True)
        s = _sinks(c)
        assert err(w.run(d.q, d.layer, sinks=s), _ref(c, d, s)) < 2e-5
    assert sorted(k[2] for k in w._sink_inners) == [False, True]


def test_sinks_go_as_float32_and_k_scale_is_folded_into_the_variants_scale():
    c = dataclasses.replace(case((3, 2), (4, 7)), sm_scale=0.3)
    d = C.make_paged(c, "cpu", F32)
    w = _prefill()
    _plan_prefill(w, d, c, sink_logits=True, sm_scale=0.3)
    s = _sinks(c)
    out = w.run(d.q, d.layer, sinks=s.to(torch.float16), k_scale=0.5, v_scale=2.0)  # the stand-in wants float32
    scaled = C.PagedData(d.q, d.layer, d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, d.kv_lens,
                         [(k * 0.5, v * 2.0) for k, v in d.keys])
    assert err(out, C.paged_oracle(c, scaled, True, s.half().float())) < 2e-5


# -- the combinations the variant does not compute: refused at plan, naming what runs -------------

@pytest.mark.parametrize("kw,what", [
    ({"logits_soft_cap": 30.0}, "logits_soft_cap=30.0"),
    ({"kv_data_type": torch.float8_e4m3fn}, "a torch.float8_e4m3fn cache under torch.float32 queries"),
])
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_sinks_with_soft_cap_or_fp8_are_refused_before_anything_is_planned(kind, kw, what):
    c = case((1, 1), (5, 9)) if kind == "decode" else case((3, 1), (4, 6))
    d = C.make_paged(c, "cpu", F32)
    if kind == "decode":
        w = FlashInferDecodeWrapper(WS, HQ, HKV, 16, 4, device=CPU)
        plan = _plan_decode
    elif kind == "mixed":
        w = FlashInferMixedWrapper(WS, WS, HQ, HKV, 16, 4, 2, 4, int(d.layer.shape[0]), 1, CPU)
        plan = _plan_prefill
    else:
        w = _prefill()
        plan = _plan_prefill
    plan(w, d, c)
    with pytest.raises(Unsupported, match=f"sink logits with {what}: FlashInfer's sink logits run with K/V in the "
                                          "query dtype .* no FP8 cache.*without logits_soft_cap, on backends fa2 "
                                          "and fa3"):
        plan(w, d, c, sink_logits=True, **kw)
    assert err(w.run(d.q, d.layer), _ref(c, d, None)) < 2e-5  # the previous plan stands


def test_sinks_on_a_backend_without_the_variant_are_refused():
    c = case((3, 1), (4, 6))
    d = C.make_paged(c, "cpu", F32)
    w = _prefill(backend="cudnn")
    with pytest.raises(Unsupported, match=r"sink logits on backend 'cudnn'.*on backends fa2 and fa3 \(or 'auto'\)"):
        _plan_prefill(w, d, c, sink_logits=True)


# -- the module name: one module per head dim -------------------------------------------------------

def test_flashinfers_own_sink_wrapper_shares_one_module_across_head_dims():
    """What the workaround is for: BatchAttentionWithAttentionSinkWrapper names its module without
    the head dim, so a second head dim in one process gets the first's module (the stand-in raises
    where the real library would load it)."""
    import flashinfer

    flashinfer.BatchAttentionWithAttentionSinkWrapper(WS, backend="fa2", q_data_type=F32, kv_data_type=F32,
                                                      head_dim_qk=16, head_dim_vo=16)
    with pytest.raises(AssertionError, match="already built in this process"):
        flashinfer.BatchAttentionWithAttentionSinkWrapper(WS, backend="fa2", q_data_type=F32, kv_data_type=F32,
                                                          head_dim_qk=32, head_dim_vo=32)


def test_two_head_dims_in_one_process_each_run_their_own_module():
    for head_dim in (16, 32, 16):
        c = dataclasses.replace(case((3, 2), (4, 7)), head_dim=head_dim)
        d = C.make_paged(c, "cpu", F32)
        w = _prefill(head_dim)
        _plan_prefill(w, d, c, sink_logits=True)
        s = _sinks(c)
        assert err(w.run(d.q, d.layer, sinks=s), _ref(c, d, s)) < 2e-5
        (inner,) = w._sink_inners.values()
        assert inner._variant.uri == sink_variant.module_name(F32, F32, head_dim, False, "fa2")
    assert sink_variant.module_name(torch.bfloat16, torch.bfloat16, 128, True, "fa3") == (
        "batch_prefill_attention_sink_bfloat16_kv_bfloat16_head_dim_128_swa_True_fa3")


# -- graph mode: the sink variant on the static buffers ------------------------------------------

def _prefill_graph(**kw):
    return FlashInferPrefillWrapper(WS, HQ, HKV, 16, 4, batch_size=4, max_total_tokens=32, max_num_pages=48,
                                    device=CPU, accelerator_graph=True, **kw)


def test_graph_prefill_sink_variant_shares_the_static_buffers_and_replans():
    w = _prefill_graph()
    bufs = w._bufs
    for i, (q, p) in enumerate([((3, 1, 5), (4, 9, 0)), ((1, 6), (11, 2)), ((2, 2, 2, 2), (0, 1, 2, 3))]):
        c = case(q, p, seed=i)
        d = C.make_paged(c, "cpu", F32)
        _plan_prefill(w, d, c, sink_logits=True)
        inner = w._inner
        assert inner._variant is not None and inner.is_cuda_graph_enabled
        assert inner._qo_indptr_buf is bufs["qo_indptr"] and inner._paged_kv_indices_buf is bufs["kv_indices"]
        s = _sinks(c)
        n = d.q.shape[0]
        assert err(w.run(d.q, d.layer, sinks=s), _ref(c, d, s)) < 2e-5
        q_static = torch.cat([d.q, torch.randn(32 - n, *d.q.shape[1:])])  # the captured shape
        assert err(w.run(q_static, d.layer, sinks=s)[:n], _ref(c, d, s)) < 2e-5
    assert inner._max_total_num_rows == 32  # the static budget, not the first plan's tokens


def test_graph_decode_sink_variant_runs_the_static_rows():
    w = FlashInferDecodeWrapper(WS, HQ, HKV, 16, 4, batch_size=4, max_num_pages=48, device=CPU,
                                accelerator_graph=True)
    for i, p in enumerate([(5, 9, 0), (3, 2, 8, 13)]):
        c = case((1,) * len(p), p, seed=i)
        d = C.make_paged(c, "cpu", F32)
        _plan_decode(w, d, c, sink_logits=True)
        assert w._inner._qo_indptr_buf is w._bufs["qo_indptr"]
        assert w._bufs["qo_indptr"].tolist() == list(range(len(p) + 1)) + [len(p)] * (4 - len(p))
        s = _sinks(c)
        n = len(p)
        q_static = torch.cat([d.q, torch.randn(4 - n, *d.q.shape[1:])])
        assert err(w.run(q_static, d.layer, sinks=s)[:n], _ref(c, d, s)) < 2e-5
        with pytest.raises(InputError, match=r"expected 4 \(static\)"):
            w.run(d.q[:1], d.layer, sinks=s)


def test_graph_mixed_sink_variant_on_both_halves():
    c = case((1, 5, 1, 3), (6, 2, 9, 4))
    d = C.make_paged(c, "cpu", F32)
    w = FlashInferMixedWrapper(WS, WS, HQ, HKV, 16, 4, 4, 16, int(d.layer.shape[0]), 2, CPU)
    _plan_prefill(w, d, c, sink_logits=True)
    assert w._dec._sink_plan is not None and w._pre._sink_plan is not None
    s = _sinks(c)
    n = d.q.shape[0]
    ref = _ref(c, d, s)
    assert err(w.run(d.q, d.layer, sinks=s), ref) < 2e-5
    q_static = torch.cat([d.q, torch.randn(16 - n, *d.q.shape[1:])])
    assert err(w.run(q_static, d.layer, sinks=s)[:n], ref) < 2e-5
    with pytest.raises(InputError, match="FlashInferMixedWrapper.run: the plan was made with sink_logits=True"):
        w.run(d.q, d.layer)
