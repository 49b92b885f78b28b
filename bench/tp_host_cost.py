"""Where eager tensor-parallel steps spend host time: per call, the host microseconds of an eager
NCCL all-reduce of one decode step's [rows, hidden] activations against those of one plain kernel
launch (an add of the same tensor), no synchronisation between calls. Run under torchrun:

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/tp_host_cost.py [--rows 8 --hidden 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def host_us(fn, n: int = 200, rounds: int = 7) -> float:
    """Median over rounds of the host time per call of ``fn`` (n calls, then one sync)."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=8192)
    a = ap.parse_args()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    x = torch.zeros(a.rows, a.hidden, dtype=torch.bfloat16, device=dev)
    res = {
        "rank": dist.get_rank(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "all_reduce_host_us": host_us(lambda: dist.all_reduce(x)),
        "add_host_us": host_us(lambda: x.add_(0)),
        "rows": a.rows, "hidden": a.hidden,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if dist.get_rank() == 0:
        print(json.dumps(gathered, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
