"""Where this step's tokens go in the paged cache, computed from a plan's host arrays.

The KV manager computes its own write locations; a wrapper keeps its plan's host arrays and
computes these only when asked (``kv_write_locations()``), so a plan pays nothing for them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class KVWriteLocations(NamedTuple):
    """Token i of the packed step writes to ``layer[pages[i], :, offsets[i]]``; int64, on device."""

    pages: torch.Tensor
    offsets: torch.Tensor


def write_locations(
    qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_indices: np.ndarray, kv_lens: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's queries are its last ``q_len`` keys: token j of row r sits at position
    ``kv_lens[r] - q_len[r] + j``."""
    qo = qo_indptr.astype(np.int64)
    q_lens = np.diff(qo)
    rows = np.repeat(np.arange(q_lens.shape[0]), q_lens)
    pos = (kv_lens.astype(np.int64) - q_lens)[rows] + (np.arange(int(qo[-1]) - int(qo[0])) + qo[0] - qo[rows])
    pages = kv_indices.astype(np.int64)[kv_indptr.astype(np.int64)[rows] + pos // page_size]
    return pages, pos % page_size


def to_device(pages: np.ndarray, offsets: np.ndarray, device: torch.device) -> KVWriteLocations:
    return KVWriteLocations(torch.from_numpy(pages).to(device), torch.from_numpy(offsets).to(device))
