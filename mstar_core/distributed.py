"""Tensor-parallel readiness on an existing ``torch.distributed`` process group.

KV heads are sharded over ranks (each rank holds ``num_kv_heads / world`` heads and the query
heads that read them). Every rank must make the same admission decisions, so after warm-up
resources check that their free pages / slots agree across ranks and fail loudly when not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard_heads(num_qo_heads: int, num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """Heads one rank holds: ``(num_qo_heads / world, num_kv_heads / world)``."""
    if world_size < 1 or num_kv_heads % world_size or num_qo_heads % world_size:
        raise ValueError(
            f"cannot shard {num_qo_heads} query / {num_kv_heads} KV heads over {world_size} ranks: "
            "both must be multiples of the world size"
        )
    return num_qo_heads // world_size, num_kv_heads // world_size


def tp_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_same_across_ranks(what: str, value: int, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank unless ``value`` is identical on all ranks (min == max, by two
    all-reduces). A no-op without an initialised process group of more than one rank."""
    if not tp_active():
        return
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    lo = torch.tensor([value], dtype=torch.int64, device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if int(lo) != int(hi):
        raise RuntimeError(
            f"tensor-parallel ranks disagree on {what}: rank {dist.get_rank(group)} has {value}, "
            f"ranks range from {int(lo)} to {int(hi)}; admission decisions have diverged"
        )
