"""FlashInferPrefixedPrefillWrapper: the dense path's one varlen pass, over FlashInfer's
``BatchPrefillWithRaggedKVCacheWrapper`` -- used where FA3 has no kernel for the GPU."""

from __future__ import annotations

from typing import Self

import torch

from mstar_core.plugin import (
    PREFIXED_RAGGED,
    InputError,
    RaggedPlan,
    StateError,
    Unsupported,
    WrapperSize,
    check_same_device,
    refuse_sinks,
)
from mstar_flashinfer.head_dim import check_flashinfer_head_dim
from mstar_flashinfer.jit_notice import plan_first_use
from mstar_flashinfer.library import flashinfer
from mstar_flashinfer.loose import loose_ragged, plan_object
from mstar_flashinfer.nvtx import Nvtx
from mstar_flashinfer.refusals import refuse_keyless
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
        size = WrapperSize(num_qo_heads, num_kv_heads, head_dim, torch.device(device), options={"backend": backend})
        check_flashinfer_head_dim(head_dim, size.device)  # the loose constructor: against the one declaration
        if workspace_buffer is None:
            nbytes = DEFAULT_WORKSPACE_BYTES if size.device.type == "cuda" else 1024
            workspace_buffer = torch.empty(nbytes, dtype=torch.uint8, device=size.device)
        self._init(size, workspace_buffer)

    @classmethod
    def from_size(cls, size: WrapperSize) -> Self:
        """Contract 2.0: a wrapper for ``size``, its workspace made here and FlashInfer's
        ``backend`` read from ``size.options`` (the registry has checked head dim and dtypes)."""
        w = cls.__new__(cls)
        w._init(size, size.workspace())
        return w

    def _init(self, size: WrapperSize, workspace_buffer: torch.Tensor) -> None:
        self.device = size.device
        self.num_qo_heads, self.num_kv_heads, self.head_dim = size.num_qo_heads, size.num_kv_heads, size.head_dim
        self.workspace_buffer = workspace_buffer
        self.backend = str(size.options.get("backend", "auto"))
        self._inner = flashinfer().BatchPrefillWithRaggedKVCacheWrapper(workspace_buffer, "NHD", backend=self.backend)
        self._staging = Staging(self.device)
        self._nvtx = Nvtx("mstar.flashinfer.ragged", False, self.device)
        self._tokens: tuple[int, int] | None = None

    def plan(
        self,
        cu_q: RaggedPlan | torch.Tensor,
        cu_k: torch.Tensor | None = None,
        max_q: int | None = None,
        max_k: int | None = None,
        causal: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
    ) -> None:
        """Contract 2.0: ``plan(RaggedPlan)``, built and checked by the core; the loose form
        builds that plan with the core's ``ragged_plan``. Host ``cu_q``/``cu_k`` preferred
        (FlashInfer plans on the host; a device tensor costs a synchronisation).
        ``logits_soft_cap``: FlashInfer's soft-cap of the scaled scores."""
        who = f"{type(self).__name__}.plan"
        plan = plan_object(cu_q, cu_k is not None, PREFIXED_RAGGED, who)
        if plan is None:
            plan = loose_ragged(who, self.device, cu_q, cu_k, max_q, max_k, causal, dtype, sm_scale, window_left,
                                logits_soft_cap)
        assert isinstance(plan, RaggedPlan)
        if plan.sink_logits:
            raise Unsupported(f"{who}: sink logits are not supported by {NO_SINKS}")
        k = plan.cu_k.numpy()
        if not plan.keys_cover_queries:
            refuse_keyless(who, plan.cu_q, k[1:] - k[:-1], plan.causal, "segment")
        dtype, soft_cap = plan.dtype, plan.logits_soft_cap
        st = self._staging
        st.begin()
        q_s, k_s = st.put("cu_q", plan.cu_q.numpy()), st.put("cu_k", k)
        st.wait_previous()  # FlashInfer's own pinned plan buffer: see staging.py
        with plan_first_use("ragged prefill", dtype, dtype, self.head_dim, plan.window_left, soft_cap, self.backend):
            self._inner.plan(
                q_s, k_s, self.num_qo_heads, self.num_kv_heads, self.head_dim, causal=plan.causal,
                window_left=plan.window_left, sm_scale=plan.sm_scale, logits_soft_cap=soft_cap, q_data_type=dtype,
                kv_data_type=dtype, non_blocking=True,
            )
        st.end()
        self._tokens = (plan.tokens, int(k[-1]))

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
