"""On the GPU: every feature the FlashInfer backend declares, through the conformance
suite against the real FlashInfer in bf16 (FP8 e4m3/e5m2 KV with bf16 queries and K/V scales,
soft-cap, both combined, sink logits alone and windowed), the paged manager over a step mixing
windowed and full layers on an FP8 cache, and multi-token decode rows replayed from CUDA graphs. Errors go to
``$OUT/flashinfer_gpu_features.json`` when ``OUT`` is set.

Head dim 128 and page size 16 only: each other variant is one more JIT compile (20-80 s).
"""

from __future__ import annotations

import pytest
import torch

from mstar_core import AttentionFeatures
from mstar_core.testing import conformance as C
from mstar_flashinfer.plugin import FLASHINFER

from ...helpers import write_results
from .test_conformance_standin import sinks_refused
from .test_gpu_flashinfer import REAL, REAL_DEVICE_INDICES

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
RESULTS: list[dict] = []

# The declared combinations the sink variant refuses (with soft-cap or FP8) are the CPU suite's
# to check (test_conformance_standin); here every case that runs.
PREFILL = [c for c in C.feature_cases("prefill", FLASHINFER.supports("paged_prefill"), page_sizes=(16,))
           if not sinks_refused(c)]
DECODE = [c for c in C.feature_cases("decode", FLASHINFER.supports("paged_decode"), page_sizes=(16,))
          if not sinks_refused(c)]
MIXED = [c for c in C.feature_cases("mixed", FLASHINFER.supports("mixed"), page_sizes=(16,)) if not sinks_refused(c)]
RAGGED = C.ragged_feature_cases(FLASHINFER.supports("prefixed_ragged"))


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    write_results("flashinfer_gpu_features", RESULTS, ("flashinfer-python",))


@pytest.fixture(params=["real", "real-device-indices"])
def backend(request):
    fi = pytest.importorskip("flashinfer")
    assert not getattr(fi, "STANDIN", False)
    return REAL if request.param == "real" else REAL_DEVICE_INDICES


def _record(kind, backend, case, err):
    RESULTS.append({"test": kind, "backend": backend.name, "case": str(case), "rel_error": err})


@pytest.mark.parametrize("case", PREFILL, ids=str)
def test_prefill_features(backend, case):
    _record("prefill", backend, case, C.check_prefill(backend, case))


@pytest.mark.parametrize("case", DECODE, ids=str)
def test_decode_features(backend, case):
    _record("decode", backend, case, C.check_decode(backend, case))


@pytest.mark.parametrize("case", MIXED, ids=str)
def test_mixed_features(case):
    pytest.importorskip("flashinfer")
    _record("mixed", REAL, case, C.check_mixed(REAL, case))


@pytest.mark.parametrize("case", RAGGED, ids=str)
def test_ragged_features(case):
    pytest.importorskip("flashinfer")
    _record("ragged", REAL, case, C.check_ragged(REAL, case))


def test_fp8_windowed_and_full_layers_in_one_step():
    """The paged manager over an FP8 cache: layers with different windows in one step, each
    against the oracle over what the cache holds (quantised K/V times the layer's scales)."""
    pytest.importorskip("flashinfer")
    from mstar_core import (
        KVConfig,
        KVManager,
        KVSpan,
        KVStep,
        Node,
        PagedAttentionManager,
        Step,
    )
    from mstar_core.testing.oracle import attention_oracle, rel_error
    from mstar_flashinfer.decode import FlashInferDecodeWrapper
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    from ...helpers import stored

    layers, hkv, hq, d = 3, 2, 8, 128
    f = AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=(0.5, 1.0, 2.0), v_scale=0.5, soft_cap=30.0,
                          layer_windows=(16, -1, 16))
    cfg = KVConfig(layers, hkv, d, 16, 64, hq)
    kv = KVManager(cfg, "cuda", BF16, features=f)
    wrappers = {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
                "mixed": FlashInferMixedWrapper}
    # max_total_tokens sized to the test: the mixed wrapper's fa2 prefill half (FP8 caches plan on
    # fa2) sizes its split-KV scratch for it, and the default 16384 needs ~272 MB of workspace
    attn = PagedAttentionManager(kv, "cuda", BF16, cfg, wrappers, max_total_tokens=512)
    node = Node([kv, attn])
    for r in "ab":
        node.ingest_request(r)
    gen = torch.Generator().manual_seed(0)
    hist: dict = {}
    errs = []
    for spans in ([("a", 40), ("b", 7)], [("a", 1), ("b", 1)], [("a", 1), ("b", 9)]):
        def forward(ctx):
            (label, lay), = ctx.plan_results["kv"].labels
            n = lay.num_tokens
            for layer in range(layers):
                q, k, v = (torch.randn(n, h, d, generator=gen).to("cuda", BF16) for h in (hq, hkv, hkv))
                kv.write_kv(k, v, layer, label)
                out = attn.run(q, label, kv.layer_view(layer), layer_idx=layer)
                ks, vs = stored(f, layer, k.cpu(), v.cpu())
                for s in lay.spans:
                    sl = slice(s.q_start, s.q_start + s.to_compute)
                    old_k, old_v = hist.get((s.request_id, layer), (ks[:0], vs[:0]))
                    all_k, all_v = torch.cat([old_k, ks[sl]]), torch.cat([old_v, vs[sl]])
                    ref = attention_oracle(q[sl].cpu().double(), all_k, all_v, True, f.window(layer, -1), None,
                                           f.soft_cap)
                    errs.append(rel_error(out[sl], ref))
                    hist[(s.request_id, layer)] = (all_k, all_v)

        assert node.step(Step(KVStep(tuple(KVSpan(r, "t", n) for r, n in spans))), forward).outcome
    RESULTS.append({"test": "fp8_layer_windows_manager", "rel_errors": errs})
    assert max(errs) < C.TOLERANCE[BF16], errs


@pytest.mark.parametrize("t", [2, 4])
def test_multi_token_decode_graph_replay(t):
    """Uniform rows of ``t`` tokens captured in CUDA graphs on the FlashInfer wrappers,
    pre-planned, against the tiny decoder's no-cache forward."""
    pytest.importorskip("flashinfer")
    from mstar_flashinfer.decode import FlashInferDecodeWrapper
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    from ...helpers import multi_token_graph_node, verify_multi_token_decode

    wrappers = {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
                "mixed": FlashInferMixedWrapper}
    model, _, _, node, runner = multi_token_graph_node(t, wrappers=wrappers, dtype=BF16, head_dim=128, device="cuda")
    runner.warmup()
    assert runner.enabled
    verify_multi_token_decode(model, node, runner, t, atol=None)
