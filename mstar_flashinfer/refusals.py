"""What the FlashInfer wrappers refuse beyond the core's plan checks (``paged_plan`` /
``ragged_plan``, done once before a plan reaches them): what FlashInfer itself cannot compute
or hold. Each runs on values the plan already carries; the error paths alone look further."""

from __future__ import annotations

import numpy as np
import torch

from mstar_core.plugin import InputError


def require(name: str, value: int | None, why: str) -> int:
    """A size that graph mode needs: static buffers are sized from it."""
    if value is None or value < 1:
        raise InputError(f"{name} is required {why} (static buffers are sized from it), got {value!r}")
    return int(value)


def refuse_keyless(who: str, cu_q: torch.Tensor, k_lens: np.ndarray, causal: bool, unit: str) -> None:
    """A plan whose ``keys_cover_queries`` is False, refused naming the first such ``unit`` ("row"
    or "segment"): FlashInfer leaves a query that sees no key undefined (0.5.3's sm90 kernel
    returns the mean of the loaded values) where the contract asks for zeros."""
    q = cu_q.numpy()
    q_lens = q[1:] - q[:-1]
    short = (q_lens > k_lens) if causal else ((q_lens > 0) & (k_lens == 0))
    i = int(np.flatnonzero(short)[0])
    raise InputError(f"{who}: {unit} {i} has {int(q_lens[i])} queries but {int(k_lens[i])} keys; a {unit}'s "
                     "queries are its last keys and FlashInfer leaves a query that sees no key undefined, so a "
                     f"{unit} needs at least as many keys as queries")


def refuse_page_range(who: str, indices: np.ndarray, max_num_pages: int) -> None:
    """Graph mode: a page index at or past the static ``max_num_pages`` (the caller compared the
    plan's ``max_page``), refused naming the first."""
    i = int(np.flatnonzero(indices >= max_num_pages)[0])
    raise InputError(f"{who}: kv_indices[{i}] = {int(indices[i])} is out of range; page indices must be "
                     f"< max_num_pages={max_num_pages}")
