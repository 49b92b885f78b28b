"""Host-to-device staging for graph replays: per-slot page-locked buffers and the fences that
guard their reuse.

An asynchronous H2D copy reads its pinned source when the stream reaches it, not when it is
issued. A host that plans step N+1 while step N is still queued must not overwrite the buffer
step N's copy will read: each plan writes the slot its step was given (steps alternate), and a
slot is reused only after the event recorded behind its last copies has fired — normally long
ago, so the check is an ``Event.query()``, not a device sync. The same holds for the device
buffers a captured graph reads: step N+1's copies go to its own slot's buffers.

``copy`` and the fence class are attributes so a test can stand in a deferred copy engine and
provoke the race on a CPU (tests/core/test_staging_race.py).
"""

from __future__ import annotations

import torch


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


class SlotStaging:
    """``slots`` sets of named buffers: pinned host ones and the static device ones a captured
    graph reads. ``stage(slot, {name: host_tensor})`` waits for the slot's previous copies,
    writes the host data into the slot's pinned buffers and issues the async copies."""

    fence_class: type = Fence

    def __init__(self, device: torch.device, slots: int, sizes: dict[str, int], dtype: torch.dtype = torch.int64) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.device = device
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.host = [{n: torch.zeros(k, dtype=dtype, pin_memory=pin) for n, k in sizes.items()} for _ in range(slots)]
        self.dev = [{n: torch.zeros(k, dtype=dtype, device=device) for n, k in sizes.items()} for _ in range(slots)]
        self.fences = [self.fence_class(device) for _ in range(slots)]
        self.sizes = dict(sizes)

    @property
    def slots(self) -> int:
        return len(self.host)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def stage(self, slot: int, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Device views (of the slot's static buffers) holding ``arrays`` once the copies run."""
        self.fences[slot].wait()
        out = {}
        for name, a in arrays.items():
            n = a.numel()
            if n > self.sizes[name]:
                raise ValueError(f"staging: {name} has {n} entries, the static buffer holds {self.sizes[name]}")
            h, d = self.host[slot][name][:n], self.dev[slot][name][:n]
            h.copy_(a)
            self.copy(d, h)
            out[name] = d
        self.fences[slot].record()
        return out
