"""How the captured decode step of the hf_bench workload splits between mstar's attention and
transformers' own layers: the bucket-64 graph replayed back to back (``timing.kernel_ms``) with
attention (FlashInfer, K/V at context ~520) and with every layer's attention replaced by a no-op
(``q`` returned, no K/V write), in the same process. Run: ``python3 bench/hf_attention_share.py``."""

from __future__ import annotations

import json
import sys

import torch

from transformers_decode import llama_1b
from timing import kernel_ms, versions

from mstar_core.integrations.transformers import Engine, EngineOptions, run


class NoAttention(Engine):
    def attend(self, module, q, k, v, mask, kwargs):  # noqa: ANN001, ANN201 - the same binding, minus attention
        return q


def graph_ms(cls: type[Engine], model, prompts) -> float:
    pages = 64 * -(-(512 + 16) // 16) + 65
    with cls(model, "flashinfer", EngineOptions(max_pages=pages, max_batch_size=64)) as engine:
        run(engine, prompts, 16)  # plans of a real decode step at context ~520 in the bucket-64 graphs
        g = engine.runner._graphs[(64, 0)]  # noqa: SLF001
        return kernel_ms(g.replay, reps=20, rounds=7)


def main() -> int:
    model = llama_1b(128256, 2048, 16, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128256, (512,), generator=gen).tolist() for _ in range(64)]
    full = graph_ms(Engine, model, prompts)
    bare = graph_ms(NoAttention, model, prompts)
    out = {"versions": versions("transformers", "flashinfer-python"), "graph_ms_with_attention": full,
           "graph_ms_without_attention": bare, "attention_ms": full - bare, "attention_share": (full - bare) / full}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
