"""mstar's FA3 paged wrappers (``flash_attn_with_kvcache``) through the conformance suite and the
kit's re-planning checks on CPU, over the stand-in written to the real signature, in the 16-bit
dtypes the kernel takes (the stand-in computes in float32)."""

import inspect

import pytest
import torch

from mstar_core.testing import conformance as C
from mstar_core.testing import reuse
from mstar_fa3.paged import FA3DecodeWrapper, FA3MixedWrapper, FA3PrefillWrapper
from mstar_fa3.plugin import FA3
from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

FA = C.WrapperSet("fa3-standin", FA3PrefillWrapper, FA3DecodeWrapper, FA3MixedWrapper, FA3PrefixedPrefillWrapper,
                  device="cpu", dtype=torch.bfloat16)
FA16 = C.WrapperSet("fa3-standin", FA3PrefillWrapper, FA3DecodeWrapper, FA3MixedWrapper, device="cpu",
                    dtype=torch.float16)

pytestmark = pytest.mark.usefixtures("fa3_standin")

# flash_attn_interface.py (tokenspeed-fa3 3.0.0): flash_attn_with_kvcache's parameters, in order
REAL_KVCACHE = [
    "q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
    "cache_leftpad", "page_table", "cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q", "rotary_seqlens",
    "q_descale", "k_descale", "v_descale", "softmax_scale", "causal", "window_size", "attention_chunk", "softcap",
    "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin", "return_softmax_lse",
    "sinks",
]
REAL_SCHEDULER = [
    "batch_size", "max_seqlen_q", "max_seqlen_k", "num_heads_q", "num_heads_kv", "headdim", "cache_seqlens",
    "qkv_dtype", "headdim_v", "cu_seqlens_q", "cu_seqlens_k_new", "cache_leftpad", "page_size", "max_seqlen_k_new",
    "causal", "window_size", "attention_chunk", "has_softcap", "num_splits", "pack_gqa", "sm_margin",
]


def test_standin_signatures_are_the_real_ones(fa3_standin):
    assert list(inspect.signature(fa3_standin.flash_attn_with_kvcache).parameters) == REAL_KVCACHE
    assert list(inspect.signature(fa3_standin.get_scheduler_metadata).parameters) == REAL_SCHEDULER


@pytest.mark.parametrize("ws", [FA, FA16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", C.prefill_cases(), ids=str)
def test_prefill(case, ws):
    C.check_prefill(ws, case)


@pytest.mark.parametrize("ws", [FA, FA16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", C.decode_cases(), ids=str)
def test_decode(case, ws):
    C.check_decode(ws, case)


@pytest.mark.parametrize("ws", [FA, FA16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", C.mixed_cases(), ids=str)
def test_mixed(case, ws):
    C.check_mixed(ws, case)


@pytest.mark.parametrize("case", C.feature_cases("prefill", FA3.supports("paged_prefill")), ids=str)
def test_prefill_features(case):
    C.check_prefill(FA, case)


@pytest.mark.parametrize("case", C.feature_cases("decode", FA3.supports("paged_decode")), ids=str)
def test_decode_features(case):
    C.check_decode(FA, case)


@pytest.mark.parametrize("case", C.feature_cases("mixed", FA3.supports("mixed")), ids=str)
def test_mixed_features(case):
    C.check_mixed(FA, case)


@pytest.mark.parametrize("case", C.multi_token_cases(64), ids=str)
def test_multi_token_decode_rows_on_the_decode_wrapper(case):
    C.check_decode(FA, case)


@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_replan_and_refused_plans(kind):
    reuse.check_replan(FA, kind, 64)
    reuse.check_refused(FA, kind, 64)
    reuse.check_layers(FA, kind, 64)


def test_bad_inputs_are_refused_naming_what_is_allowed():
    from mstar_core.errors import InputError, InputTypeError, Unsupported

    ws = torch.empty(8, dtype=torch.uint8)
    with pytest.raises(InputError, match="head_dim a multiple of 8 in 8..256"):
        FA3DecodeWrapper(ws, 8, 2, 100, 16, device="cpu")
    with pytest.raises(InputError, match="needs batch_size"):
        FA3DecodeWrapper(ws, 8, 2, 64, 16, device="cpu", accelerator_graph=True)
    w = FA3DecodeWrapper(ws, 8, 2, 64, 16, device="cpu")
    i32 = dict(dtype=torch.int32)
    indptr, idx, last = torch.tensor([0, 1], **i32), torch.tensor([5], **i32), torch.tensor([3], **i32)
    with pytest.raises(InputTypeError, match="FA3 computes in torch.float16, torch.bfloat16"):
        w.plan(indptr, idx, last, dtype=torch.float32)
    with pytest.raises(Unsupported, match="FP8 cache only with FP8 queries"):
        w.plan(indptr, idx, last, dtype=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(InputError, match=r"last_page_len\[0\] = 17 .* allowed: 1..16"):
        w.plan(indptr, idx, torch.tensor([17], **i32), dtype=torch.bfloat16)
    w.plan(indptr, idx, last, dtype=torch.bfloat16)
    layer = torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16)  # pages 0..3: the plan reads page 5
    with pytest.raises(InputError, match="the plan reads page 5 but kv_cache_layer has 4 pages"):
        w.run(torch.zeros(1, 8, 64, dtype=torch.bfloat16), layer)
    with pytest.raises(InputError, match=r"q has shape \(2, 8, 64\), expected \[1, 8, 64\]"):
        w.run(torch.zeros(2, 8, 64, dtype=torch.bfloat16), torch.zeros(6, 2, 16, 2, 64, dtype=torch.bfloat16))
