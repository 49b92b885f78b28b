"""On two GPUs (NCCL, torchrun): `mstar generate --tp 2` on a Llama-shaped model, loaded sharded by
transformers (safetensors) or whole and sharded by mstar (config only: random weights from the
seed), generates the ids of `--tp 1` in float32, and runs bf16 with CUDA graphs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mstar_core.testing.hf_models import build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _generate(directory, *argv, tp=1):
    cmd = [*(TORCHRUN if tp > 1 else [sys.executable]), "-m", "mstar_core.cli", "generate", str(directory), "--ids",
           "--prompt", "1,2,3,4,5", "--prompt", "9 8 7", "--prompt", " ".join(map(str, range(40))),
           "--max-new-tokens", "24", "--ignore-eos", "--device", "cuda", "--json", *argv,
           *(["--tp", str(tp)] if tp > 1 else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{"): p.stdout.rindex("}") + 1])


@pytest.mark.parametrize("weights", ["safetensors", "seed"])
def test_generate_tp2_on_cuda(weights, tmp_path):
    model = build("llama", "gpu")
    if weights == "safetensors":
        model.save_pretrained(tmp_path)
    else:
        model.config.save_pretrained(tmp_path)
    f32 = ["--dtype", "float32", "--backend", "reference"]
    one, two = _generate(tmp_path, *f32), _generate(tmp_path, *f32, tp=2)
    assert two["sharded_by"] == ("transformers" if weights == "safetensors" else "mstar")
    assert two["ids"] == one["ids"]
    bf16 = _generate(tmp_path, "--dtype", "bfloat16", tp=2)
    assert bf16["graph_steps"] > 0 and bf16["decode_step_ms_median"] is not None  # decode replayed CUDA graphs
    assert len(bf16["ids"]) == 3 and all(len(x) == 24 for x in bf16["ids"])
