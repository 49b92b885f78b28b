"""On the GPU: the sampler's draws for float32 logits are the CPU's (the hash is the same on
every device), it captures in a CUDA graph (nothing in it syncs with the host) whose replays draw
what eager steps draw, and a transformers model samples the same tokens with and without graphs."""

from __future__ import annotations

import pytest
import torch

from mstar_core.sampling import Sampler, SamplingParams
from mstar_core.testing.hf_models import build

pytestmark = pytest.mark.gpu
VOCAB = 50000
PARAMS = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2, seed=i)
          if i % 3 else SamplingParams(temperature=1.0, seed=i) for i in range(64)]


def _sampler(device: str) -> Sampler:
    s = Sampler(device, 64, VOCAB)
    s.set_rows([s.admit(p, p.seed, list(range(i, i + 20))) for i, p in enumerate(PARAMS)])
    return s


def test_draws_on_the_gpu_are_the_cpus_and_replay_in_a_graph():
    torch.manual_seed(0)
    logits = torch.randn(64, VOCAB) * 3
    positions = torch.arange(64) + 100
    cpu = _sampler("cpu").sample(logits, positions)
    gpu = _sampler("cuda")
    eager = gpu.sample(logits.cuda(), positions.cuda()).cpu()
    # Summation order differs (the CDF): a draw may flip only where it falls on a boundary.
    assert (eager == cpu).float().mean() >= 0.98, (eager != cpu).sum()

    captured = _sampler("cuda")
    x, pos = logits.cuda(), positions.cuda()
    out = torch.empty(64, dtype=torch.long, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(captured.sample(x, pos))  # the warm-up run, as the runner does
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(captured.sample(x, pos))
    ref = _sampler("cuda")
    ref.sample(x, pos)  # the warm-up's draw, so the seen tables agree
    for step in range(3):
        pos += 1
        g.replay()
        want = ref.sample(x, pos)
        assert torch.equal(out, want), step


@pytest.mark.requires_transformers
def test_a_model_samples_the_same_tokens_with_and_without_graphs():
    from mstar_core import generate

    model = build("llama", "gpu", dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 30, 12, 64)]
    params = PARAMS[:4]
    eager = generate(model, prompts, 16, sampling=params, graphs=False)
    assert generate(model, prompts, 16, sampling=params, graphs=True) == eager
