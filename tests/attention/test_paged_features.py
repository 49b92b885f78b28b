"""Attention features through the paged managers: FP8 KV with per-layer scales,
soft-cap, sink logits and per-layer windows, step by step against the float64 oracle; and every
bad input refused with the cache untouched."""

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    AttentionStep,
    BackendUnavailable,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
    select_backend,
)
from mstar_core.features import KV_DTYPES
from mstar_core.testing.oracle import attention_oracle, rel_error

from ..helpers import REF_WRAPPERS, stored

LAYERS, HKV, HQ, D = 3, 2, 4, 8


def make(features: AttentionFeatures, dtype=torch.float32, max_pages=32, page_size=4, manager_features=None):
    cfg = KVConfig(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, page_size=page_size, max_pages=max_pages,
                   num_qo_heads=HQ)
    kv = KVManager(cfg, "cpu", dtype, features=features)
    attn = PagedAttentionManager(kv, "cpu", dtype, cfg, REF_WRAPPERS, features=manager_features)
    node = Node([attn, kv])
    for rid in "abc":
        node.ingest_request(rid)
    return kv, attn, node


PLAIN_STEP = AttentionStep()


def run_steps(features, schedule, sinks=None, attn_step=PLAIN_STEP, dtype=torch.float32, seed=0,
              manager_features=None):
    """Steps of ``schedule`` (lists of ``(rid, tokens)``) on every layer; returns the worst
    relative error per layer against the oracle over what each stream stored."""
    kv, attn, node = make(features, dtype, manager_features=manager_features)
    gen = torch.Generator().manual_seed(seed)
    hist: dict = {}
    worst = [0.0] * LAYERS

    def forward(ctx):
        (label, lay), = ctx.plan_results["kv"].labels
        n = lay.num_tokens
        for layer in range(LAYERS):
            q = torch.randn(n, HQ, D, generator=gen).to(dtype)
            k = torch.randn(n, HKV, D, generator=gen).to(dtype)
            v = torch.randn(n, HKV, D, generator=gen).to(dtype)
            kv.write_kv(k, v, layer, label)
            s_l = None if sinks is None else sinks[layer]
            out = attn.run(q, label, kv.layer_view(layer), layer_idx=layer, sinks=s_l)
            ks, vs = stored(features, layer, k, v)
            for s in lay.spans:
                sl = slice(s.q_start, s.q_start + s.to_compute)
                key = (s.request_id, layer)
                old_k, old_v = hist.get(key, (ks[:0], vs[:0]))
                all_k, all_v = torch.cat([old_k, ks[sl]]), torch.cat([old_v, vs[sl]])
                window = features.window(layer, attn_step.window_left)
                ref = attention_oracle(q[sl], all_k, all_v, True, window, None, features.soft_cap, s_l)
                worst[layer] = max(worst[layer], rel_error(out[sl], ref))
                hist[key] = (all_k, all_v)

    for spans in schedule:
        step = Step(KVStep(tuple(KVSpan(r, "t", n) for r, n in spans)), attn_step)
        assert node.step(step, forward).outcome
    return worst, kv, attn


# a prompt step, a mixed step, then decode steps past several pages
SCHEDULE = [[("a", 9), ("b", 3)], [("a", 1), ("b", 6), ("c", 5)], [("a", 1), ("b", 1), ("c", 1)],
            [("a", 1), ("b", 1), ("c", 1)]]


def test_step_mixing_windowed_and_full_layers_plans_once_per_window():
    f = AttentionFeatures(layer_windows=(2, -1, 2))
    worst, _, attn = run_steps(f, SCHEDULE)
    assert max(worst) < 1e-5, worst
    (entry,) = attn._current.entries  # the last step's plan (it has landed: not current)
    assert sorted(entry.per_window) == [-1, 2]  # two distinct windows: two plans, not three
    assert entry.per_window[2][0] is not entry.per_window[-1][0]


def test_a_manager_ignoring_the_layer_windows_fails_the_check():
    """The check above can fail: a manager that plans every layer with full attention is off by
    far more than rounding on the windowed layers (the oracle still applies their windows)."""
    worst, _, _ = run_steps(AttentionFeatures(layer_windows=(2, -1, 2)), SCHEDULE, manager_features=AttentionFeatures())
    assert worst[1] < 1e-5 and worst[0] > 0.05 and worst[2] > 0.05, worst


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_with_per_layer_scales(kv_dtype):
    f = AttentionFeatures(kv_dtype=kv_dtype, k_scale=(0.5, 1.0, 2.0), v_scale=(2.0, 0.25, 1.0))
    worst, kv, _ = run_steps(f, SCHEDULE)
    assert kv.storage.dtype == KV_DTYPES[kv_dtype]
    assert max(worst) < 1e-5, worst


def test_fp8_storage_is_quantized_with_the_layers_scale():
    f = AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=(0.5, 1.0, 4.0), v_scale=1.0)
    kv, _, node = make(f)
    big = torch.full((2, HKV, D), 3.0)

    def forward(ctx):
        for layer in range(LAYERS):
            kv.write_kv(big, big, layer, "t")

    node.step(Step(KVStep((KVSpan("a", "t", 2),))), forward)
    page = kv.streams[("a", "t")].pages[0]
    assert [float(kv.storage[layer, page, 0, 0, 0, 0]) for layer in range(LAYERS)] == [6.0, 3.0, 0.75]


def test_soft_cap_and_sink_logits():
    f = AttentionFeatures(soft_cap=1.5, sink_logits=True)
    sinks = [torch.randn(HQ) for _ in range(LAYERS)]
    worst, _, _ = run_steps(f, SCHEDULE, sinks=sinks)
    assert max(worst) < 1e-5, worst


def test_every_feature_at_once():
    f = AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=0.5, v_scale=(1.0, 2.0, 0.5), soft_cap=2.0, sink_logits=True,
                          layer_windows=(-1, 3, 1))
    sinks = [torch.randn(HQ) * 2 for _ in range(LAYERS)]
    worst, _, _ = run_steps(f, SCHEDULE, sinks=sinks)
    assert max(worst) < 1e-5, worst


def test_selection_gets_the_managers_features():
    f = AttentionFeatures(kv_dtype="fp8_e4m3", soft_cap=30.0, sink_logits=True, layer_windows=(4, -1))
    sel = select_backend(device="cpu", features=f)
    assert sel.name == "reference"
    with pytest.raises(BackendUnavailable, match="does not support feature sink_logits"):
        select_backend(capabilities=("bounded",), device="cpu", features=AttentionFeatures(sink_logits=True))


# -- bad input: a clear error naming the value and what is allowed; the cache untouched --------

@pytest.mark.parametrize("kw, match", [
    ({"kv_dtype": "fp8_e4m3", "k_scale": 0.0}, r"k_scale must be a finite float > 0.*, got 0.0"),
    ({"kv_dtype": "fp8_e4m3", "v_scale": float("nan")}, r"v_scale must be a finite float > 0.*, got nan"),
    ({"kv_dtype": "fp8_e4m3", "k_scale": (1.0, -2.0)}, r"k_scale\[1\] must be a finite float > 0.*, got -2.0"),
    ({"soft_cap": float("inf")}, r"soft_cap must be a finite float > 0.*, got inf"),
    ({"kv_dtype": "fp4"}, r"kv_dtype 'fp4' is not supported; choose one of \['auto', 'fp8_e4m3', 'fp8_e5m2'\]"),
    ({"layer_windows": (3, -2)}, r"layer_windows\[1\] must be an int >= 0, or -1"),
    ({"decode_query_tokens": 9}, r"decode_query_tokens must be an int in 1..8, got 9"),
    ({"sink_logits": 1}, r"sink_logits must be a bool"),
])
def test_bad_feature_values(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AttentionFeatures(**kw)


def test_per_layer_values_must_name_every_layer():
    with pytest.raises(ValueError, match=r"features.k_scale has 2 entries, the model 3 layers"):
        make(AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=(1.0, 2.0)))
    with pytest.raises(ValueError, match=r"features.layer_windows has 4 entries, the model 3 layers"):
        make(AttentionFeatures(layer_windows=(1, 2, 3, 4)))


def test_a_window_the_cache_cannot_outgrow_is_full_attention():
    """A window as long as the cache (32 pages x 4 = 128 tokens) or longer masks nothing: the
    layer is planned as a full one, and matches the oracle, which applies the window itself."""
    worst, _, attn = run_steps(AttentionFeatures(layer_windows=(128, -1, 4096)), SCHEDULE)
    assert attn.features.layer_windows == (-1, -1, -1)
    assert max(worst) < 1e-5, worst
    _, attn, _ = make(AttentionFeatures(layer_windows=(127, -1, 4)))
    assert attn.features.layer_windows == (127, -1, 4)  # shorter than the cache: kept


def _snapshot(kv, attn):
    return kv.storage.clone(), kv.pool.num_free, dict(attn._planned), {k: s.length for k, s in kv.streams.items()}


def _same(a, b):
    assert torch.equal(a[0].float(), b[0].float()) and a[1:] == b[1:]


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(HQ + 1), r"sinks has shape \(5,\), expected \(4,\) \(one logit per query head\)"),
    (torch.zeros(HQ, dtype=torch.int64), r"sinks must be a float tensor, got dtype torch.int64"),
    ([0.0] * HQ, r"sinks must be a float tensor \[num_qo_heads=4\], got list"),
])
def test_bad_sinks_refused_and_nothing_changes(bad, match):
    kv, attn, node = make(AttentionFeatures(sink_logits=True))
    step = Step(KVStep((KVSpan("a", "t", 3),)))
    before = _snapshot(kv, attn)

    def forward(ctx):
        attn.run(torch.randn(3, HQ, D), "t", kv.layer_view(0), layer_idx=0, sinks=bad)

    with pytest.raises((ValueError, TypeError), match=match):
        node.step(step, forward)
    after = _snapshot(kv, attn)
    assert torch.equal(after[0], before[0]) and after[1] == before[1] and after[3] == before[3]  # rolled back


def test_sinks_without_the_feature_are_refused():
    kv, attn, node = make(AttentionFeatures())

    def forward(ctx):
        attn.run(torch.randn(2, HQ, D), "t", kv.layer_view(0), layer_idx=0, sinks=torch.zeros(HQ))

    with pytest.raises(ValueError, match=r"sinks given, but the features do not ask for sink logits"):
        node.step(Step(KVStep((KVSpan("a", "t", 2),))), forward)


def test_step_window_with_per_layer_windows_is_refused_before_planning():
    kv, attn, node = make(AttentionFeatures(layer_windows=(2, -1, 2)))
    before = _snapshot(kv, attn)
    with pytest.raises(ValueError, match=r"the step sets window_left=4, but the features give each layer its window"):
        node.step(Step(KVStep((KVSpan("a", "t", 2),)), AttentionStep(window_left=4)), lambda ctx: None)
    _same(before, _snapshot(kv, attn))


def test_kv_dtype_the_backend_lacks_is_refused_by_selection():
    with pytest.raises(BackendUnavailable, match=r"does not support feature fp8_e5m2 .* in bounded"):
        select_backend(capabilities=("bounded",), requested="reference", device="cpu",
                       features=AttentionFeatures(kv_dtype="fp8_e5m2"))
    # The dense path's wrappers take K/V in the model dtype (the manager dequantises the prefix):
    # FP8 is not asked of them.
    assert select_backend(capabilities=("prefixed_ragged",), requested="reference", device="cpu",
                          features=AttentionFeatures(kv_dtype="fp8_e5m2")).name == "reference"


def test_run_without_layer_idx_where_a_layer_decides():
    for f, match in ((AttentionFeatures(layer_windows=(2, -1, 2)), "run needs layer_idx"),
                     (AttentionFeatures(kv_dtype="fp8_e4m3"), "an FP8 KV cache has scales per layer")):
        kv, attn, node = make(f)

        def forward(ctx, kv=kv, attn=attn):
            attn.run(torch.randn(2, HQ, D), "t", kv.layer_view(0))

        with pytest.raises(ValueError, match=match):
            node.step(Step(KVStep((KVSpan("a", "t", 2),))), forward)


def test_steps_with_other_windows_reuse_the_wrappers():
    """A wrapper is kept per (label, kind, slot) and re-planned with each step's window, not one
    per distinct window a step ever asked for (each holds a workspace)."""
    _, attn, node = make(AttentionFeatures())
    for w in range(2, 10):
        assert node.step(Step(KVStep((KVSpan("a", "t", 1),)), AttentionStep(window_left=w)), lambda ctx: None).outcome
    assert len(attn._wrappers) == attn.slots  # decode steps alternate two slots
