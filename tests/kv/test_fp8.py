"""FP8 KV storage: finite values saturate at the format's largest value; a non-finite value stays
non-finite (inf in e5m2, NaN in e4m3fn), so a poisoned K or V reads back as poisoned, as the
model-dtype cache's would, and the row's attention output is NaN rather than plausible."""

import math

import pytest
import torch

from mstar_core import AttentionFeatures, KVConfig, KVManager, KVSpan, KVStep, Node, PagedAttentionManager, Step
from mstar_core.kv.fp8 import dequantize, quantize

from ..helpers import REF_WRAPPERS

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("dtype", list(FP8.values()), ids=list(FP8))
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float64])
def test_non_finite_stays_non_finite_and_finite_saturates(dtype, src):
    top = torch.finfo(dtype).max
    x = torch.tensor([math.inf, -math.inf, math.nan, 1e6, -1e6, 0.75, -3.0]).to(src)
    got = quantize(x, 0.5, dtype).float()
    if dtype == torch.float8_e5m2:
        assert got[0] == math.inf and got[1] == -math.inf
    else:  # no inf in e4m3fn: NaN, never its largest finite value
        assert got[:2].isnan().all()
    assert got[2].isnan()
    assert got[3] == top and got[4] == -top  # finite and out of range: saturated
    assert torch.equal(got[5:], (x[5:].float() / 0.5).to(dtype).float())  # in range: the plain cast


@pytest.mark.parametrize("dtype", list(FP8.values()), ids=list(FP8))
def test_a_finite_value_whose_quotient_overflows_float32_still_saturates(dtype):
    x = torch.tensor([1e300, -1e300], dtype=torch.float64)
    assert quantize(x, 1e-30, dtype).float().tolist() == [torch.finfo(dtype).max, -torch.finfo(dtype).max]


@pytest.mark.parametrize("kv_dtype", ["auto", *FP8])
def test_an_inf_key_poisons_its_row_and_no_other(kv_dtype):
    cfg = KVConfig(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, max_pages=8, num_qo_heads=4)
    feats = AttentionFeatures(kv_dtype=kv_dtype) if kv_dtype == "auto" else \
        AttentionFeatures(kv_dtype=kv_dtype, k_scale=0.5, v_scale=2.0)
    kv = KVManager(cfg, "cpu", torch.float32, features=feats)
    attn = PagedAttentionManager(kv, "cpu", torch.float32, cfg, REF_WRAPPERS)
    node = Node([kv, attn])
    for r in "ab":
        node.ingest_request(r)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(6, 2, 8, generator=gen)
    v = torch.randn(6, 2, 8, generator=gen)
    q = torch.randn(6, 4, 8, generator=gen)
    k[1, 0, 3] = math.inf  # a's second token
    v[2, 1, 0] = -math.inf  # a's third token
    step = Step(KVStep((KVSpan("a", "t", 3), KVSpan("b", "t", 3))))

    def forward(ctx):
        kv.write_kv(k, v, 0, "t")
        return attn.run(q, "t", kv.layer_view(0), layer_idx=0)

    out = node.step(step, forward).output
    # Query heads 0-1 read KV head 0 (the inf key, a's token 1), heads 2-3 KV head 1 (the inf
    # value, token 2); causal, so token 0 sees neither.
    assert out[1, :2].isnan().all() and out[2].isnan().all(), "a query that sees a non-finite K or V gives NaN"
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, 2:]).all()
    assert torch.isfinite(out[3:]).all(), "b never sees a's keys"
    # What the pages hold for a's poisoned token reads back non-finite, as in the model dtype.
    stream = kv.stream("a", "t")
    page = kv.storage[0, stream.pages[0]]
    scale = 1.0 if kv_dtype == "auto" else 0.5
    assert not torch.isfinite(dequantize(page[0, 1, 0, 3], scale, torch.float32))
    assert not torch.isfinite(dequantize(page[1, 2, 1, 0], 2.0 if kv_dtype != "auto" else 1.0, torch.float32))
    kv.post_warmup_validate()
    assert kv.num_free_pages == 8 - 2  # one page per stream, nothing else held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", list(FP8.values()), ids=list(FP8))
def test_dequantize_reads_fp8_storage_times_its_scale_in_the_model_dtype(fp8, dtype):
    stored = torch.tensor([1.5, -0.25, 0.0, 96.0]).to(fp8)  # exact in both formats
    assert dequantize(stored, 2.0, dtype).tolist() == [3.0, -0.5, 0.0, 192.0]
    assert dequantize(stored, 0.5, dtype).tolist() == [0.75, -0.125, 0.0, 48.0]
    assert dequantize(stored, 1.0, dtype).tolist() == [1.5, -0.25, 0.0, 96.0]  # scale 1: only the cast
    assert {dequantize(stored, s, dtype).dtype for s in (2.0, 1.0)} == {dtype}


def test_dequantize_scales_storage_already_in_the_model_dtype():
    stored = torch.tensor([1.5, -0.25, 96.0])
    assert dequantize(stored, 0.5, torch.float32).tolist() == [0.75, -0.125, 48.0]


def test_dequantize_of_model_dtype_storage_at_scale_one_is_the_storage_itself():
    # the dense path reads a model-dtype cache through it: no copy of the pages
    stored = torch.tensor([1.5, -0.25, 96.0], dtype=torch.bfloat16)
    assert dequantize(stored, 1.0, torch.bfloat16) is stored


@pytest.mark.parametrize("fp8", list(FP8.values()), ids=list(FP8))
def test_dequantize_undoes_quantize_up_to_the_formats_rounding(fp8):
    x = torch.linspace(-3.0, 3.0, 25)
    back = dequantize(quantize(x, 0.25, fp8), 0.25, torch.float32)
    assert torch.allclose(back, x, rtol=torch.finfo(fp8).eps / 2, atol=0)  # half a unit in the last place
