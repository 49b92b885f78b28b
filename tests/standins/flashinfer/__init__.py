"""A stand-in for ``flashinfer`` 0.5.3 in plain PyTorch, for tests only (never installed).

It keeps the real library's constructor, ``plan`` and ``run`` signatures, its CUDA-graph-mode
contract (static ``*_buf`` tensors given at construction, updated by ``plan`` with ``.copy_()``,
the same errors on overflow) and its conventions (NHD cache ``[pages, 2, page_size, H, D]``,
bottom-right causal mask, ``window_left``, int32 indices, dtype checks between plan and run).
``run`` computes from the device-side buffers a real kernel would read, so a wrapper that plans
wrong buffer contents gets wrong numbers here too. Arithmetic: mstar's reference math.

``emulate("0.7.2.post1")`` / ``emulate("0.7.4")`` switch on the behaviour those releases changed
where the plugin can tell (see ``_common.Profile``); the signatures stay 0.5.3's otherwise.

Features, as 0.5.3 does them (see ``_common``: soft_cap_on, run_sm_scale, apply_v_scale,
refuse_sinks): ``logits_soft_cap > 0`` turns each score ``s`` (after the scale) into
``cap * tanh(s / cap)``; an FP8 (e4m3/e5m2) cache is read as stored and converted to float,
``q_scale``/``k_scale`` multiply ``sm_scale`` and ``v_scale`` the output after the kernel; ``run``
checks the cache dtype against the plan's ``kv_data_type`` (ValueError). ``run(..., sinks=)``:
0.5.3 drops the sinks silently on its fa2/fa3 paths; the stand-in raises NotImplementedError.
Sink logits that do apply: ``BatchAttentionWithAttentionSinkWrapper`` (attention.py), the paged
prefill's jit path for the AttentionSink variant (``_variant``), the only ``jit_args`` modelled.

Not modelled: custom masks, RoPE/ALiBi, FP8 queries, return_lse, other jit variants, trtllm-gen.
"""

import sys

from . import prefill as _prefill
from ._common import PROFILE
from .attention import BatchAttentionWithAttentionSinkWrapper
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .page import get_seq_lens
from .prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)

__version__ = "0.5.3"
STANDIN = True  # lets a test tell the stand-in from the real library
VERSIONS = ("0.5.3", "0.7.2.post1", "0.7.4")


def emulate(version: str) -> None:
    """Behave as FlashInfer ``version`` (one of ``VERSIONS``) from now on, for wrappers built after."""
    if version not in VERSIONS:
        raise ValueError(f"the stand-in emulates {VERSIONS}, not {version!r}")
    mod = sys.modules[__name__]
    mod.__version__ = PROFILE.version = version
    PROFILE.q_rows_check = version != "0.5.3"
    mod.BatchPrefillWithPagedKVCacheWrapper = (
        _prefill.BatchPrefillWithPagedKVCacheWrapper074 if version == "0.7.4"
        else _prefill.BatchPrefillWithPagedKVCacheWrapper)

__all__ = [
    "BatchAttentionWithAttentionSinkWrapper",
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "get_seq_lens",
]
