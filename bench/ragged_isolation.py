"""Which rows does NaN/inf in one segment reach, through a backend's prefixed ragged wrapper?
(issue 15: `mstar check flashinfer` found segment 1's poison in another segment's output.)

For each poisoned component (q, k, v, or all three) of segment 1 of three, and each FlashInfer
backend choice (or FA3), prints every segment's state: ok (within bf16 tolerance of the float64
oracle of clean inputs), nonfinite, or wrong.

    python bench/ragged_isolation.py flashinfer|fa3
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from mstar_core.testing.conformance import TOLERANCE
from mstar_core.testing.oracle import attention_oracle, rel_error

Q_LENS, PREFIX = (9, 16, 5), (7, 16, 3)
HQ, HKV, D, BF16 = 8, 2, 128, torch.bfloat16


def wrappers(lib: str):
    if lib == "fa3":
        from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

        return {"fa3": lambda: FA3PrefixedPrefillWrapper(HQ, HKV, D, torch.device("cuda"))}
    from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    return {b: (lambda b=b: FlashInferPrefixedPrefillWrapper(HQ, HKV, D, torch.device("cuda"), workspace_buffer=ws,
                                                              backend=b)) for b in ("auto", "fa2", "fa3")}


def main(lib: str) -> None:
    gen = torch.Generator().manual_seed(0)
    k_lens = [p + q for p, q in zip(PREFIX, Q_LENS)]
    cu_q = torch.tensor([0, *itertools.accumulate(Q_LENS)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), HQ, D, generator=gen).to(BF16)
    k = torch.randn(int(cu_k[-1]), HKV, D, generator=gen).to(BF16)
    v = torch.randn(int(cu_k[-1]), HKV, D, generator=gen).to(BF16)
    refs = [attention_oracle(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]], True)
            for i in range(3)]
    rows = []
    for name, make in wrappers(lib).items():
        for what in ("none", "q", "k", "v", "all"):
            qq, kk, vv = q.clone(), k.clone(), v.clone()
            if what in ("q", "all"):
                qq[cu_q[1]:cu_q[2]] = float("nan")
            if what in ("k", "all"):
                kk[cu_k[1]:cu_k[2]] = float("inf")
            if what in ("v", "all"):
                vv[cu_k[1]:cu_k[2]] = float("nan")
            w = make()
            w.plan(cu_q, cu_k, max(Q_LENS), max(k_lens), causal=True, dtype=BF16)
            out = w.run(qq.cuda(), kk.cuda(), vv.cuda()).cpu()
            states = []
            for i in range(3):
                seg = out[cu_q[i]:cu_q[i + 1]]
                if not torch.isfinite(seg.float()).all():
                    states.append("nonfinite")
                else:
                    states.append("ok" if rel_error(seg, refs[i]) <= TOLERANCE[BF16] else "wrong")
            rows.append({"wrapper": f"{lib}:{name}", "poisoned": what, "segments": states})
            print(f"{lib}:{name:5} poison {what:4} in segment 1 -> segments 0, 1, 2: {', '.join(states)}", flush=True)
    print(json.dumps({"q_lens": Q_LENS, "prefix_lens": PREFIX, "rows": rows}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "flashinfer")
