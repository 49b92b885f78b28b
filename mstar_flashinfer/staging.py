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
wrapper object; a manager that keeps one wrapper per slot (seed 000's
``force_double_buffer`` note) never waits on it.

Off CUDA (CPU tests through a stand-in) buffers are ordinary host memory and fences are no-ops.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar_core.staging import Staging  # noqa: F401  (re-exported: the wrappers stage through it)


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
