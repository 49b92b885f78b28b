"""Where the host's time goes in mstar's generate loop on the GPU (cProfile of one run of the
hf_bench workload, after a warm-up run): the decode step's wall time exceeds the captured graph's
GPU time when the host's per-step work does. Run: ``python3 bench/hf_host_profile.py``."""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from transformers_decode import llama_1b

from mstar_core.integrations.transformers import Engine, EngineOptions, run


def main() -> int:
    new = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    model = llama_1b(128256, 2048, 16, torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128256, (512,), generator=g).tolist() for _ in range(64)]
    pages = 64 * -(-(512 + new) // 16) + 65
    with Engine(model, "flashinfer", EngineOptions(max_pages=pages, max_batch_size=64)) as engine:
        run(engine, prompts, 8)
        prof = cProfile.Profile()
        prof.enable()
        rep = run(engine, prompts, new)
        prof.disable()
    print("\n".join(rep.lines()), flush=True)
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumtime").print_stats(45)
    return 0


if __name__ == "__main__":
    sys.exit(main())
