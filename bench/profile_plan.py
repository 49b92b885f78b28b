"""Where a wrapper's plan() spends host time, against raw FlashInfer's (cProfile, GPU idle).

    python3 bench/profile_plan.py > $OUT/profile_plan.txt
"""

import cProfile
import io
import pstats

import torch

import flashinfer
from mstar_flashinfer.decode import FlashInferDecodeWrapper

HQ, HKV, D, PS, BF16 = 32, 8, 128, 16, torch.bfloat16


def layout(rows, kv_len):
    pages = -(-kv_len // PS)
    i32 = dict(dtype=torch.int32)
    return (torch.arange(rows + 1, **i32) * pages, torch.randperm(rows * pages).to(torch.int32),
            torch.full((rows,), kv_len - (pages - 1) * PS, **i32), torch.full((rows,), kv_len, **i32))


def prof(name, fn, n=50):
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
        torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print(f"==== {name} ({n} calls)\n{s.getvalue()}")


ws = lambda: torch.empty(128 << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
for rows, kv in ((256, 2048), (64, 8192)):
    indptr, indices, last, lens = layout(rows, kv)
    raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
    w = FlashInferDecodeWrapper(ws(), HQ, HKV, D, PS, device="cuda")
    prof(f"raw decode plan {rows}x{kv}", lambda: raw.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, kv_data_type=BF16))
    prof(f"wrapper decode plan {rows}x{kv}", lambda: w.plan(indptr, indices, last, dtype=BF16, kv_lens=lens))
    prof(f"wrapper decode plan {rows}x{kv}, no kv_lens", lambda: w.plan(indptr, indices, last, dtype=BF16))
