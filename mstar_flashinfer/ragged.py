"""FlashInferPrefixedPrefillWrapper: the dense path's one varlen pass, over FlashInfer's
``BatchPrefillWithRaggedKVCacheWrapper`` -- used where FA3 has no kernel for the GPU."""

from __future__ import annotations

import numpy as np
import torch

from mstar_core.plugin import InputError, StateError, check_same_device, check_soft_cap, check_varlen_plan, refuse_sinks
from mstar_flashinfer import validate
from mstar_flashinfer.jit_notice import plan_first_use
from mstar_flashinfer.library import flashinfer
from mstar_flashinfer.nvtx import Nvtx
from mstar_flashinfer.staging import Staging

# FlashInfer 0.5.3's ragged prefill ``run`` takes no ``sinks`` (prefill.py:2840-2849): refused.
NO_SINKS = "the FlashInfer dense path (its ragged prefill takes no sinks; the paged paths do)"

# FlashInfer's recommended workspace; off CUDA (a stand-in) nothing is read from it.
DEFAULT_WORKSPACE_BYTES = 128 << 20


class FlashInferPrefixedPrefillWrapper:
    """Segment i's queries ``q[cu_q[i]:cu_q[i+1]]`` attend keys ``k[cu_k[i]:cu_k[i+1]]`` =
    [frozen prefix | fresh tokens]; the causal mask is aligned bottom-right (FlashInfer's
    convention), so the prefix is visible to every query.

    Eager only: the dense path's shapes change every step, so nothing here is captured.
    ``max_q``/``max_k`` are part of the protocol (FA3 needs them); FlashInfer derives its own.
    """

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        workspace_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        validate.check_geometry(num_qo_heads, num_kv_heads, head_dim, self.device)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        if workspace_buffer is None:
            size = DEFAULT_WORKSPACE_BYTES if self.device.type == "cuda" else 1024
            workspace_buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.workspace_buffer = workspace_buffer
        self.backend = backend
        self._inner = flashinfer().BatchPrefillWithRaggedKVCacheWrapper(workspace_buffer, "NHD", backend=backend)
        self._staging = Staging(self.device)
        self._nvtx = Nvtx("mstar.flashinfer.ragged", False, self.device)
        self._dtype_checked: torch.dtype | None = None
        self._tokens: tuple[int, int] | None = None

    def plan(
        self,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
    ) -> None:
        """Host ``cu_q``/``cu_k`` preferred (FlashInfer plans on the host; a device tensor costs a
        synchronisation). ``logits_soft_cap``: FlashInfer's soft-cap of the scaled scores."""
        soft_cap = check_soft_cap(logits_soft_cap, f"{type(self).__name__}.plan")
        if dtype is not self._dtype_checked:
            validate.check_dtype(dtype, self.device)
            self._dtype_checked = dtype
        q_t, k_t = check_varlen_plan(f"{type(self).__name__}.plan", cu_q, cu_k, max_q, max_k, sm_scale, window_left)
        q_arr, k_arr = q_t.numpy(), k_t.numpy()
        validate.check_keys_cover_queries(f"{type(self).__name__}.plan", np.diff(q_arr), np.diff(k_arr), causal,
                                          "segment")
        st = self._staging
        st.begin()
        q_s, k_s = st.put("cu_q", q_arr), st.put("cu_k", k_arr)
        st.wait_previous()  # FlashInfer's own pinned plan buffer: see staging.py
        with plan_first_use("ragged prefill", dtype, dtype, self.head_dim, window_left, soft_cap, self.backend):
            self._inner.plan(
                q_s, k_s, self.num_qo_heads, self.num_kv_heads, self.head_dim, causal=causal, window_left=window_left,
                sm_scale=sm_scale, logits_soft_cap=soft_cap, q_data_type=dtype, kv_data_type=dtype, non_blocking=True,
            )
        st.end()
        self._tokens = (int(q_arr[-1]), int(k_arr[-1]))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None
            ) -> torch.Tensor:
        """``q`` ``[cu_q[-1], Hq, D]``, ``k``/``v`` ``[cu_k[-1], Hkv, D]``; returns ``[cu_q[-1], Hq, D]``.
        Sink logits are refused (``NO_SINKS``)."""
        refuse_sinks(sinks, type(self).__name__, NO_SINKS)
        if self._tokens is None:
            raise StateError("FlashInferPrefixedPrefillWrapper.run before plan")
        tq, tk = self._tokens
        check_same_device(f"{type(self).__name__}.run", self.device, q=q, k=k, v=v)
        if q.shape[0] != tq or k.shape[0] != tk or v.shape[0] != tk:
            raise InputError(
                f"{type(self).__name__}.run: q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} tokens, the plan has "
                f"{tq} queries and {tk} keys (cu_q[-1], cu_k[-1])"
            )
        return self._inner.run(q, k, v)
