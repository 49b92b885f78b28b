"""A prefixed ragged wrapper over a FlashAttention-style ``flash_attn_varlen_func`` — what the
FA3 and AITER backends share (they differ in the module, the head dims and a keyword or two).

Segment i's queries ``q[cu_q[i]:cu_q[i+1]]`` attend keys ``k[cu_k[i]:cu_k[i+1]]`` =
[frozen prefix | fresh]; these kernels align their causal mask bottom-right, which is what a
prefix needs. ``plan`` moves ``cu_q``/``cu_k`` to the device once per step; ``run`` (per layer)
is one kernel call. Library versions differ in what the function returns (``out`` alone, or
``(out, lse)``): both are accepted.

``plan`` refuses, before it changes anything (a refused plan keeps the previous one), ``cu``
arrays a kernel would index out of bounds with -- empty, not 1-D, not integers, not starting at
0, decreasing, a different segment count for q and k -- and ``max_q``/``max_k`` below the
longest segment, a bad ``window_left`` or ``sm_scale``. ``run`` refuses q/k/v whose token
counts are not the plan's ``cu[-1]`` or that sit on different devices. The FlashInfer ragged
wrapper uses the same checks (:func:`check_varlen_plan`, :func:`check_same_device`).
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Self

import torch

from mstar_core.attention.checks import check_sinks, check_soft_cap
from mstar_core.attention.plans import PagedPlan, RaggedPlan, WrapperSize
from mstar_core.errors import InputError, InputTypeError, StateError, Unsupported
from mstar_core.step import check_window_and_scale, is_int

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


_INT32_MAX = 2**31 - 1
_CU_ENTRIES = " with at least one entry (segment starts, then the total: [0, ..., tokens])"


def host_int32(name: str, value: Any, who: str, min_entries: int = 0, what: str = "") -> torch.Tensor:
    """``value`` as a 1-D int32 CPU tensor of at least ``min_entries`` entries (``what``: said
    after "1-D" when it is not one), refusing floats, bools, other ranks and values outside
    int32 (a device tensor is copied to the host here, which synchronises: pass host arrays)."""
    if isinstance(value, torch.Tensor):
        t = value
    else:
        try:  # numpy arrays too, without mstar-core importing numpy
            t = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputTypeError(f"{who}: {name} must be a 1-D integer tensor or array, got {type(value).__name__} "
                            f"({e})") from None
    if t.dim() != 1 or t.numel() < min_entries:
        raise InputError(f"{who}: {name} must be 1-D{what}, got shape {tuple(t.shape)}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise InputTypeError(f"{who}: {name} must hold integers (int32), got dtype {t.dtype}")
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype != torch.int32:
        lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 0)
        if lo < -_INT32_MAX - 1 or hi > _INT32_MAX:
            raise InputError(f"{who}: {name} holds {hi if hi > _INT32_MAX else lo}, outside int32")
        t = t.to(torch.int32)
    return t


def check_offsets(name: str, t: torch.Tensor, who: str, unit: str = "segment") -> torch.Tensor:
    """``t`` starts at 0 and never decreases; returns the ``unit`` lengths (``t[1:] - t[:-1]``)."""
    if int(t[0]) != 0:
        raise InputError(f"{who}: {name} must start at 0, got {name}[0] = {int(t[0])} ({name} = {_head(t)})")
    lengths = t[1:] - t[:-1]
    drops = lengths < 0
    if bool(drops.any()):
        i = int(drops.nonzero()[0, 0])
        raise InputError(f"{who}: {name} must be non-decreasing ({unit} lengths >= 0), got {name}[{i}] = "
                         f"{int(t[i])} > {name}[{i + 1}] = {int(t[i + 1])}")
    return lengths


def _head(t: torch.Tensor, n: int = 8) -> str:
    vals = t[:n].tolist()
    return str(vals)[:-1] + (", ...]" if t.numel() > n else "]")


def check_varlen_plan(who: str, cu_q: Any, cu_k: Any, max_q: Any, max_k: Any, sm_scale: Any = None,
                      window_left: Any = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Every refusal a prefixed ragged ``plan`` makes before it changes anything: ``cu_q``/``cu_k``
    1-D integer arrays of the same length (segments + 1), starting at 0, non-decreasing;
    ``max_q``/``max_k`` ints at least the longest segment; the mask parameters. Returns the cu
    arrays as int32 CPU tensors. A few vectorised ops on arrays of segments + 1 entries."""
    q_t = host_int32("cu_q", cu_q, who, 1, _CU_ENTRIES)
    k_t = host_int32("cu_k", cu_k, who, 1, _CU_ENTRIES)
    if q_t.numel() != k_t.numel():
        raise InputError(f"{who}: cu_q has {q_t.numel()} entries ({q_t.numel() - 1} segments) and cu_k "
                         f"{k_t.numel()} ({k_t.numel() - 1} segments); each segment needs both")
    check_offsets("cu_q", q_t, who)
    check_offsets("cu_k", k_t, who)
    for name, bound, t in (("max_q", max_q, q_t), ("max_k", max_k, k_t)):
        if not is_int(bound):
            raise InputTypeError(f"{who}: {name} must be an int, got {type(bound).__name__} {bound!r}")
        longest = int((t[1:] - t[:-1]).max()) if t.numel() > 1 else 0
        if bound < longest:
            raise InputError(f"{who}: {name} = {int(bound)} is below the longest segment ({longest} tokens); "
                             f"it must be at least that")
    check_window_and_scale(who, window_left, sm_scale)
    return q_t, k_t


def check_same_device(who: str, planned: torch.device, **tensors: torch.Tensor) -> None:
    """Every tensor on one device, of the planned device's type (and index, where it names one)."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise InputError(f"{who}: {name} is on {t.device} but {first_name} is on {first.device}; "
                             "every input must be on the planned device")
    dev = first.device
    if dev.type != planned.type or (planned.index is not None and dev.index != planned.index):
        raise InputError(f"{who}: {first_name} is on {dev}, the wrapper plans on {planned}")


def first_output(result: Any) -> torch.Tensor:
    """``out`` from either return convention of ``flash_attn_varlen_func``."""
    return result[0] if isinstance(result, (tuple, list)) else result


class VarlenPrefixedWrapper:
    """Subclasses name the library (``module``, shown as ``library`` in errors) and its limits.
    ``workspace_buffer`` and ``backend`` are accepted for the common constructor and unused
    (these kernels allocate what they need per call).

    Contract 2.0: built with ``from_size(WrapperSize)`` and planned with the core's
    ``RaggedPlan`` (checked there: nothing is checked again). The loose constructor and
    ``plan(cu_q, cu_k, max_q, max_k, ...)`` stay for direct (1.x-style) use, with their checks."""

    module: ClassVar[str]
    library: ClassVar[str]
    head_dim_multiple: ClassVar[int] = 1
    max_head_dim: ClassVar[int] = 256
    extra_kwargs: ClassVar[dict[str, Any]] = {}  # passed on every call
    # The function's keywords for a soft-cap and for sink logits; None where it has none (the
    # feature is then refused here, and the backend does not declare it).
    softcap_kwarg: ClassVar[str | None] = None
    sinks_kwarg: ClassVar[str | None] = None
    sinks_dtype: ClassVar[torch.dtype] = torch.float32  # what the function checks sinks against

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        workspace_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
            raise InputError(
                f"num_qo_heads ({num_qo_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        if head_dim < 1 or head_dim % self.head_dim_multiple or head_dim > self.max_head_dim:
            rule = f"a multiple of {self.head_dim_multiple} and " if self.head_dim_multiple > 1 else ""
            raise InputError(f"{self.library} varlen attention needs head_dim {rule}in 1..{self.max_head_dim}, "
                             f"got {head_dim}")
        self._init(num_qo_heads, num_kv_heads, head_dim, torch.device(device))

    @classmethod
    def from_size(cls, size: WrapperSize) -> Self:
        """Contract 2.0: a wrapper for ``size`` (no workspace: the kernel allocates per call)."""
        w = cls.__new__(cls)
        w._init(size.num_qo_heads, size.num_kv_heads, size.head_dim, size.device)
        return w

    def _init(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device = device
        # Imported here, not at module import: the plugin must load where the library is not installed.
        self._varlen = importlib.import_module(self.module).flash_attn_varlen_func
        self._planned = False

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
        """Contract 2.0: ``plan(RaggedPlan)``; the loose form checks its arguments here."""
        who = f"{type(self).__name__}.plan"
        if isinstance(cu_q, (RaggedPlan, PagedPlan)):
            if not isinstance(cu_q, RaggedPlan):
                raise InputError(f"{who}: got a {cu_q.kind} plan; this wrapper runs prefixed_ragged plans")
            if cu_k is not None:
                raise InputTypeError(f"{who}: a plan object comes alone; got other arguments with it")
            self._plan(who, cu_q.cu_q, cu_q.cu_k, cu_q.max_q, cu_q.max_k, cu_q.causal, cu_q.dtype, cu_q.sm_scale,
                       cu_q.window_left, cu_q.logits_soft_cap, cu_q.sink_logits, cu_q.tokens)
            return
        soft_cap = check_soft_cap(logits_soft_cap, who)
        if dtype not in SUPPORTED_DTYPES:
            raise InputTypeError(f"{self.library} varlen attention supports dtypes {SUPPORTED_DTYPES}, got {dtype}")
        q_t, k_t = check_varlen_plan(who, cu_q, cu_k, max_q, max_k, sm_scale, window_left)
        assert max_q is not None and max_k is not None  # check_varlen_plan refuses anything but ints
        self._plan(who, q_t, k_t, int(max_q), int(max_k), causal, dtype, sm_scale, window_left, soft_cap, False,
                   int(q_t[-1]))

    def _plan(self, who: str, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
              dtype: torch.dtype, sm_scale: float | None, window_left: int, soft_cap: float | None,
              sink_logits: bool, tokens: int) -> None:
        """What the kernel cannot run is refused first (a refused plan keeps the previous one)."""
        if soft_cap is not None and self.softcap_kwarg is None:
            raise InputError(f"{who}: {self.library} varlen attention has no soft-cap; plan without logits_soft_cap "
                             "or use a backend that declares soft_cap")
        if sink_logits and self.sinks_kwarg is None:
            raise Unsupported(f"{who}: {self.library} varlen attention takes no sink logits; use a backend that "
                              "declares sink_logits")
        self._tokens = (tokens, int(cu_k[-1]))
        # Once per step: every layer's run reuses these device copies.
        self._cu_q = cu_q.to(self.device, non_blocking=True)
        self._cu_k = cu_k.to(self.device, non_blocking=True)
        self._max = (max_q, max_k)
        self._causal = causal
        self._dtype = dtype
        self._scale = sm_scale
        # The window is (left, right) around the bottom-right-aligned diagonal; causal caps right at 0.
        self._window = (window_left, 0 if causal else -1) if window_left >= 0 else (-1, -1)
        self._extra = dict(self.extra_kwargs)
        if soft_cap is not None and self.softcap_kwarg is not None:  # a soft-cap without one was refused above
            self._extra[self.softcap_kwarg] = soft_cap
        self._planned = True

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None
            ) -> torch.Tensor:
        """One kernel call. ``sinks [Hq]``: a logit per query head added to each softmax
        denominator, where the library takes them (converted to ``sinks_dtype``)."""
        who = type(self).__name__
        if not self._planned:
            raise StateError(f"{who}.run before plan")
        extra = self._extra
        if sinks is not None:
            if self.sinks_kwarg is None:
                raise Unsupported(f"{who}.run: {self.library} varlen attention takes no sink logits; use a "
                                          "backend that declares sink_logits")
            check_sinks(sinks, self.num_qo_heads, self.device, f"{who}.run")
            extra = {**extra, self.sinks_kwarg: sinks.to(self.sinks_dtype).contiguous()}
        tq, tk = self._tokens
        check_same_device(f"{who}.run", self.device, q=q, k=k, v=v)
        hq, hkv, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        for name, t, want in (("q", q, (tq, hq, d)), ("k", k, (tk, hkv, d)), ("v", v, (tk, hkv, d))):
            if tuple(t.shape) != want:
                raise InputError(f"{who}.run: {name} has shape {tuple(t.shape)}, expected {want} "
                                 f"(the plan's cu_{'q' if name == 'q' else 'k'}[-1] = {want[0]} tokens)")
            if t.dtype != self._dtype:
                raise InputTypeError(f"{who}.run: {name} has dtype {t.dtype}, planned {self._dtype}")
        out = self._varlen(
            q, k, v, self._cu_q, self._cu_k, self._max[0], self._max[1],
            softmax_scale=self._scale, causal=self._causal, window_size=self._window, **extra,
        )
        return first_output(out)
