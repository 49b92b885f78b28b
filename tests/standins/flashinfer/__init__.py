"""A stand-in for ``flashinfer`` 0.5.3 in plain PyTorch, for tests only (never installed).

It keeps the real library's constructor, ``plan`` and ``run`` signatures, its CUDA-graph-mode
contract (static ``*_buf`` tensors given at construction, updated by ``plan`` with ``.copy_()``,
the same errors on overflow) and its conventions (NHD cache ``[pages, 2, page_size, H, D]``,
bottom-right causal mask, ``window_left``, int32 indices, dtype checks between plan and run).
``run`` computes from the device-side buffers a real kernel would read, so a wrapper that plans
wrong buffer contents gets wrong numbers here too. Arithmetic: mstar's reference math.

Not modelled: custom masks, RoPE/ALiBi, logits soft-cap, fp8 scales, return_lse, jit_args.
"""

from .decode import BatchDecodeWithPagedKVCacheWrapper
from .page import get_seq_lens
from .prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

__version__ = "0.5.3"
STANDIN = True  # lets a test tell the stand-in from the real library

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "get_seq_lens",
]
