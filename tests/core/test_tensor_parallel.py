"""Two ranks on gloo: KV heads sharded, post_warmup_validate agrees when ranks agree and fails
loudly on every rank when their free pages differ."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mstar_core import KVSpan, KVStep, Step, StepContext
from mstar_core.distributed import shard_heads
from mstar_core.resources.kv import KVConfig, KVManager


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, diverge, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hq, hkv = shard_heads(8, 4, world)
        kv = KVManager(KVConfig(2, hkv, 16, 4, 16, hq), "cpu", torch.float32)
        kv.ingest_request("a")
        n = 9 if (diverge and rank == 1) else 5  # rank 1 admits a longer span when diverging
        step = Step(KVStep((KVSpan("a", "t", n),)))
        ctx = StepContext()
        kv.admit(step, ctx)
        kv.plan(step, ctx)
        kv.commit(step, ctx)
        assert kv.storage.shape[4] == hkv
        try:
            kv.post_warmup_validate()
            results[rank] = "ok"
        except RuntimeError as e:
            results[rank] = str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("diverge", [False, True], ids=["agree", "diverge"])
def test_two_ranks_gloo(diverge):
    world = 2
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(_rank, args=(world, _free_port(), diverge, results), nprocs=world, join=True)
        got = dict(results)
    if diverge:
        for r in range(world):
            assert "ranks disagree on kv free pages" in got[r] and "range from 13 to 14" in got[r]
    else:
        assert got == {0: "ok", 1: "ok"}


def test_shard_heads_refuses_uneven():
    assert shard_heads(32, 8, 4) == (8, 2)
    with pytest.raises(ValueError, match="cannot shard 32 query / 8 KV heads over 3 ranks"):
        shard_heads(32, 8, 3)
