"""Host arrays staged in page-locked, per-slot buffers, and the fence that guards their reuse.

An async H2D copy reads its pinned source when the stream reaches it, not when it is issued. A
host that plans step N+1 while step N's copies are still queued must therefore not overwrite the
buffers step N was staged from: each plan takes the next slot (round robin), and a slot is reused
only after the event recorded behind its last copies has fired -- normally long ago, so the check
is an ``Event.query()``, not a device sync.

FlashInfer's own ``plan`` has one page-locked buffer per wrapper (its plan info, copied with
``cudaMemcpyAsync``), which no slot of ours can protect: :class:`Fence` waits, before the next
inner ``plan``, for the previous one's copies. That bounds the host to one plan ahead of the
GPU on one wrapper object; a manager that keeps one wrapper per slot (seed 000's
``force_double_buffer`` note) never waits on it.

Off CUDA (CPU tests through a stand-in) buffers are ordinary host memory and fences are no-ops.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar_core.staging import Fence  # noqa: F401  (re-exported: the wrappers fence through it)


def host_i32(t: torch.Tensor | np.ndarray | list[int]) -> np.ndarray:
    """A host int32 numpy view of an index array (no copy when it already is one). A device
    tensor is copied to the host here, which synchronises: pass host tensors."""
    if isinstance(t, np.ndarray):
        return t if t.dtype == np.int32 else t.astype(np.int32)
    if not isinstance(t, torch.Tensor):
        return np.asarray(t, dtype=np.int32)
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t.numpy()


class _Buf:
    __slots__ = ("tensor", "array")

    def __init__(self, n: int, pin: bool, dtype: torch.dtype) -> None:
        self.tensor = torch.empty(n, dtype=dtype, pin_memory=pin)
        self.array = self.tensor.numpy()


class Staging:
    """``slots`` sets of named page-locked buffers. Per plan: ``begin()`` (takes the next slot,
    waiting for its previous copies), ``put(name, array)`` for each host array (a view of the
    staged copy), then ``end()`` once every copy from this slot has been issued."""

    def __init__(self, device: torch.device, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.device = device
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self._bufs: list[dict[str, _Buf]] = [{} for _ in range(slots)]
        self._fences = [Fence(device) for _ in range(slots)]
        self.slot = -1

    @property
    def slots(self) -> int:
        return len(self._bufs)

    def reserve(self, sizes: dict[str, int], dtype: torch.dtype = torch.int32) -> None:
        """Allocate every slot's buffers now (graph mode: no allocation in the step path)."""
        for bufs in self._bufs:
            for name, n in sizes.items():
                if name not in bufs or bufs[name].tensor.numel() < n:
                    bufs[name] = _Buf(max(n, 1), self.pinned, dtype)

    def begin(self) -> int:
        self.slot = (self.slot + 1) % len(self._bufs)
        self._fences[self.slot].wait()
        return self.slot

    def put(self, name: str, arr: np.ndarray, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        bufs = self._bufs[self.slot]
        n = int(arr.shape[0])
        buf = bufs.get(name)
        if buf is None or buf.tensor.numel() < n or buf.tensor.dtype != dtype:
            # grow to the next power of two: eager shapes vary step to step
            buf = bufs[name] = _Buf(1 << max(n - 1, 0).bit_length(), self.pinned, dtype)
        np.copyto(buf.array[:n], arr, casting="unsafe")
        return buf.tensor[:n]

    def end(self) -> None:
        self._fences[self.slot].record()

    def buffer(self, slot: int, name: str) -> torch.Tensor:
        """The whole host buffer ``name`` of ``slot`` (tests check where a plan staged)."""
        return self._bufs[slot][name].tensor
