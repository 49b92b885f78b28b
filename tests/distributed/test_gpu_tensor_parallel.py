"""On two GPUs (NCCL): the demo sharded over two ranks by torchrun checks every token against the
no-cache forward; `mstar bench --tp 2` runs with graphs and pre-planning; a rank failing in the
middle of graph replays ends its peer within the timeout, with a clear error, instead of a hang."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mstar_core.distributed import STALL_GRACE_S

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "mstar_core.cli"]


def _run(cmd, timeout=600):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ})


def test_demo_tp2_on_cuda_checks_every_token():
    p = _run([*TORCHRUN, "demo", "--tp", "2", "--device", "cuda"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("tensor parallel over 2 ranks") == 1 and p.stdout.count(": OK") == 1, p.stdout


def test_bench_tp2_with_graphs_and_preplan():
    p = _run([*TORCHRUN, "bench", "--tp", "2", "--device", "cuda", "--graphs", "--preplan", "--json",
              "--layers", "2", "--hidden", "1024", "--qo-heads", "8", "--kv-heads", "2", "--head-dim", "128"])
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout[p.stdout.index("{"):])
    assert res["tp"] == 2 and res["graphs"] and res["preplan"]
    assert 0 < res["allreduce_ms"] < res["median_step_ms"]


def test_a_rank_failing_during_graph_replays_ends_its_peer_not_a_hang():
    timeout = 10
    p = _run([sys.executable, str(ROOT / "bench/tp_failure.py"), "--graphs", "--timeout", str(timeout)], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = json.loads(p.stdout)["ranks"]
    assert not ranks["0"]["hung"] and not ranks["1"]["hung"], ranks
    assert ranks["1"]["exit"] != 0 and "fails on purpose" in " ".join(ranks["1"]["stderr_tail"])
    assert ranks["0"]["exit"] != 0
    # the watchdog fires STALL_GRACE_S after the timeout; rank 1 fails some seconds into the run
    assert ranks["0"]["seconds"] - ranks["1"]["seconds"] < timeout + STALL_GRACE_S + 15, ranks
    said = " ".join(ranks["0"]["stderr_tail"])
    assert ("another tensor-parallel rank has failed or stalled" in said
            or "another rank has failed or stalled" in said), said
