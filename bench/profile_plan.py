"""Where a wrapper's plan() and a graph decode step's GraphRunner.prepare() spend host time,
against raw FlashInfer's plan (cProfile, GPU idle before each call).

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


def prof(name, fn, n=50, after=None):
    fn()
    if after is not None:
        after()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
        pr.disable()
        if after is not None:
            after()
        torch.cuda.synchronize()
        pr.enable()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"==== {name} ({n} calls)\n{s.getvalue()}")


ws = lambda: torch.empty(128 << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
for rows, kv in ((256, 2048), (64, 8192)):
    indptr, indices, last, lens = layout(rows, kv)
    raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
    w = FlashInferDecodeWrapper(ws(), HQ, HKV, D, PS, device="cuda")
    prof(f"raw decode plan {rows}x{kv}", lambda: raw.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=BF16, kv_data_type=BF16))
    prof(f"wrapper decode plan {rows}x{kv}", lambda: w.plan(indptr, indices, last, dtype=BF16, kv_lens=lens))
    prof(f"wrapper decode plan {rows}x{kv}, no kv_lens", lambda: w.plan(indptr, indices, last, dtype=BF16))


# GraphRunner.prepare of a graph decode step (admit + KV plan + attention plan), as host_bench times it
from mstar_core.demo.decode_bench import BenchOptions, build_decode_setup  # noqa: E402

for rows, kv in ((8, 512), (64, 8192)):
    o = BenchOptions(layers=1, qo_heads=HQ, kv_heads=HKV, head_dim=D, hidden=256, batch=rows, context=kv,
                     page_size=PS, backend="flashinfer", graphs=True, steps=200, warmup=1, device="cuda",
                     dtype="bfloat16")
    st = build_decode_setup(o)
    held = []
    prof(f"GraphRunner.prepare {rows}x{kv} (graph decode)", lambda st=st, held=held: held.append(st.runner.prepare(st.decode)),
         n=100, after=lambda st=st, held=held: [st.runner.discard(held.pop()) for _ in list(held)])
