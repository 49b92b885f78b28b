"""FlashInfer's sink-logit kernels: the AttentionSink JIT variant of its paged prefill, the one
path of FlashInfer 0.5.3 that applies ``sinks`` off sm100 (its plain paged wrappers drop them).

``BatchAttentionWithAttentionSinkWrapper`` builds that variant through the paged prefill's
``jit_args``, under the module name ``batch_prefill_attention_sink_{dtype}_swa_{bool}_{backend}``:
the head dims and the KV dtype are compiled into the module but not named, so a second head dim in
one process would share the first's module. :func:`build` makes the same wrapper with the same
arguments (the variant's own declaration, ``attention_sink_decl``) under a name that tells them
apart; nothing else differs.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.plugin import Unsupported
from mstar_flashinfer import compat

# The backends FlashInfer declares the AttentionSink variant for (jit/attention/variants.py).
SINK_BACKENDS = ("fa2", "fa3")


def module_name(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, sliding_window: bool, backend: str) -> str:
    """The variant's module name: what FlashInfer's own name leaves out (KV dtype, head dim) included."""
    q, kv = (str(d).removeprefix("torch.") for d in (q_dtype, kv_dtype))
    return f"batch_prefill_attention_sink_{q}_kv_{kv}_head_dim_{head_dim}_swa_{sliding_window}_{backend}"


def jit_args(fi_variants: Any, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, sliding_window: bool,
             backend: str) -> tuple[list[Any], dict[str, Any]]:
    """``BatchAttentionWithAttentionSinkWrapper.__init__``'s ``jit_args``/``jit_kwargs`` (0.5.3
    attention.py:241-260), the module name aside: one float32 tensor ``sink`` [num_qo_heads] and one
    double ``sm_scale``, passed positionally to ``run`` in that order."""
    args = [module_name(q_dtype, kv_dtype, head_dim, sliding_window, backend), q_dtype, kv_dtype, q_dtype,
            torch.int32, head_dim, head_dim, ["sink"], ["float"], ["sm_scale"], ["double"], "AttentionSink",
            fi_variants.attention_sink_decl[backend]]
    return args, {"use_sliding_window": sliding_window, "use_fp16_qk_reduction": False, "pos_encoding_mode": 0}


def resolve_backend(backend: str, device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """The variant is compiled for one backend at construction: "auto" resolved as
    ``BatchAttentionWithAttentionSinkWrapper`` resolves it (FlashInfer's determine_attention_backend)."""
    if backend != "auto":
        return backend
    from flashinfer.utils import determine_attention_backend

    return str(determine_attention_backend(device, 0, False, False, q_dtype, kv_dtype))


def build(fi: Any, workspace: torch.Tensor, backend: str, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
          sliding_window: bool, graph: dict[str, torch.Tensor] | None = None, rows: int = 0) -> Any:
    """A paged prefill wrapper running the AttentionSink variant (``backend``: "fa2" or "fa3");
    ``graph``: the static buffers of graph mode (with ``rows``, its token budget)."""
    if not hasattr(fi, "BatchAttentionWithAttentionSinkWrapper"):
        raise Unsupported(f"FlashInfer {compat.library_version(fi)} has no AttentionSink variant "
                                 "(BatchAttentionWithAttentionSinkWrapper, FlashInfer 0.5.3 and later): sink logits "
                                 "need it")
    from flashinfer.jit.attention import variants

    args, kwargs = jit_args(variants, q_dtype, kv_dtype, head_dim, sliding_window, backend)
    cls = fi.BatchPrefillWithPagedKVCacheWrapper
    if graph is None:
        return cls(workspace, "NHD", backend=backend, jit_args=args, jit_kwargs=kwargs)
    return compat.graph_prefill(
        cls, rows, workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=graph["qo_indptr"],
        paged_kv_indptr_buf=graph["kv_indptr"], paged_kv_indices_buf=graph["kv_indices"],
        paged_kv_last_page_len_buf=graph["last_page_len"], backend=backend, jit_args=args, jit_kwargs=kwargs)
