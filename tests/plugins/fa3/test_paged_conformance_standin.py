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
