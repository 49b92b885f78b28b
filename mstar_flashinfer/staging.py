"""Host arrays staged in page-locked, per-slot buffers, and the fence that guards their reuse.

An async H2D copy reads its pinned source when the stream reaches it, not when it is issued. A
host that plans step N+1 while step N's copies are still queued must therefore not overwrite the
buffers step N was staged from: each plan takes the next slot (round robin), and a slot is reused
only after the event recorded behind its last copies has fired -- normally long ago, so the check
is an ``Event.query()``, not a device sync.

FlashInfer's own ``plan`` has one page-locked buffer per wrapper (its plan info, copied with
``cudaMemcpyAsync``), which no slot of ours can protect: ``Staging.wait_previous`` waits, before
the next inner ``plan``, for the previous plan's fence (recorded after its copies and FlashInfer's,
so one event per plan guards both). That bounds the host to one plan ahead of the GPU on one
wrapper object; a manager that keeps one wrapper per slot (``force_double_buffer``) never
waits on it.

Off CUDA (CPU tests through a stand-in) buffers are ordinary host memory and fences are no-ops.
``copy`` and the fence class are attributes so a test can stand in a deferred copy engine and
provoke the race on a CPU (tests/plugins/flashinfer/test_staging_race.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mstar_core.plugin import InputError


class Fence:
    """An event recorded behind a slot's copies; ``wait()`` before the slot is written again."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._event: torch.cuda.Event | None = None

    def record(self) -> None:
        if self._cuda:
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        ev = self._event
        if ev is not None and not ev.query():
            ev.synchronize()

    @property
    def pending(self) -> bool:
        return self._event is not None and not self._event.query()


class _Buf:
    __slots__ = ("array", "tensor", "views")

    def __init__(self, n: int, pin: bool, dtype: torch.dtype) -> None:
        self.tensor = torch.empty(n, dtype=dtype, pin_memory=pin)
        self.array = self.tensor.numpy()
        self.views: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}  # put_many's, by sizes


class Staging:
    """``slots`` sets of named, growable host buffers (page-locked on CUDA). Per plan: ``begin()``
    (takes the next slot, waiting for its previous copies), ``put(name, array)`` for each host
    array (a host view of the staged copy, to copy from), then ``end()`` once every copy from this
    slot has been issued. Off CUDA the buffers are ordinary memory and the fences no-ops."""

    fence_class: type = Fence

    def __init__(self, device: torch.device, slots: int = 2) -> None:
        if slots < 1:
            raise InputError(f"slots must be >= 1, got {slots}")
        self.device = device
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self._bufs: list[dict[str, _Buf]] = [{} for _ in range(slots)]
        self._fences = [self.fence_class(device) for _ in range(slots)]
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

    def _buf(self, name: str, n: int, dtype: torch.dtype) -> _Buf:
        bufs = self._bufs[self.slot]
        buf = bufs.get(name)
        if buf is None or buf.tensor.numel() < n or buf.tensor.dtype != dtype:
            # grow to the next power of two: eager shapes vary step to step
            buf = bufs[name] = _Buf(1 << max(n - 1, 0).bit_length(), self.pinned, dtype)
        return buf

    def put_many(self, name: str, arrays: Sequence[np.ndarray], dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
        """Several 1-D numpy arrays into one buffer ``name`` of this slot, back to back; returns a
        view of each (one buffer for a plan's arrays, not one per array). The views of one
        buffer and sizes are made once: graph plans stage the same sizes step after step."""
        sizes = tuple(a.shape[0] for a in arrays)
        total = sum(sizes)
        buf = self._buf(name, total, dtype)
        host, at = buf.array, 0
        for a, n in zip(arrays, sizes, strict=True):
            np.copyto(host[at: at + n], a, casting="unsafe")
            at += n
        views = buf.views.get(sizes)
        if views is None:
            if len(buf.views) >= 64:  # eager plans of ever new sizes: keep the memo small
                buf.views.clear()
            views = buf.views[sizes] = buf.tensor[:total].split(sizes)
        return list(views)

    def put(self, name: str, arr: np.ndarray, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """Copy ``arr`` (a 1-D numpy array) into this slot's buffer ``name``; a view of the copy."""
        n = int(arr.shape[0])
        buf = self._buf(name, n, dtype)
        np.copyto(buf.array[:n], arr, casting="unsafe")
        return buf.tensor[:n]

    def wait_previous(self) -> None:
        """Wait for the copies issued up to the end of the plan before this one (its slot's
        fence): what guards a buffer that is not staged here but reused by every plan (FlashInfer's
        own page-locked plan buffer). One event per plan serves both purposes."""
        self._fences[(self.slot - 1) % len(self._fences)].wait()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue the copy of a staged host view to the device (between ``begin`` and ``end``)."""
        dst.copy_(src, non_blocking=True)

    def end(self) -> None:
        self._fences[self.slot].record()

    def buffer(self, slot: int, name: str) -> torch.Tensor:
        """The whole host buffer ``name`` of ``slot`` (tests check where a plan staged)."""
        return self._bufs[slot][name].tensor


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
