"""Tensor parallelism on two gloo ranks (CPU processes): the sharded tiny decoder computes what
the single-process one does, ranks that admit differently fail loudly on every rank, and a rank
that fails or stalls mid-run turns into a clear error on the other, not a hang."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from mstar_core import (
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Step,
    StepContext,
    TensorParallel,
)
from mstar_core.cli.parallel import launched
from mstar_core.distributed import StallWatchdog, shard_heads

from ..helpers import REF_WRAPPERS
from ..ranks import WORLD, breaking, cli_rank, run_ranks

# -- the pieces -------------------------------------------------------------------------------

def _kv_rank(rank, timeout_s, diverge):
    with launched(WORLD, "cpu", "test", timeout_s) as (tp, _):
        hq, hkv = tp.shard_heads(8, 4)
        kv = KVManager(KVConfig(2, hkv, 16, 4, 16, hq), "cpu", torch.float32, tp=tp)
        kv.ingest_request("a")
        n = 9 if (diverge and rank == 1) else 5  # rank 1 admits a longer span when diverging
        step = Step(KVStep((KVSpan("a", "t", n),)))
        ctx = StepContext()
        kv.admit(step, ctx)
        kv.plan(step, ctx)
        kv.commit(step, ctx)
        assert kv.storage.shape[4] == hkv
        kv.post_warmup_validate()
        return "validated"


@pytest.mark.slow
@pytest.mark.parametrize("diverge", [False, True], ids=["agree", "diverge"])
def test_post_warmup_validate_compares_the_ranks_kv(diverge):
    got = run_ranks(_kv_rank, diverge)
    if not diverge:
        assert got == {0: ("ok", "validated"), 1: ("ok", "validated")}
        return
    for r in range(WORLD):
        kind, msg = got[r]
        assert kind == "error" and "ranks disagree on kv free pages" in msg and "range from 13 to 14" in msg
        assert "kv tokens" in msg and "range from 5 to 9" in msg


def test_shard_heads_refuses_uneven_and_names_what_fits():
    assert shard_heads(32, 8, 4) == (8, 2)
    with pytest.raises(ValueError, match=r"cannot shard query heads 32, KV heads 8 over 3 ranks: .* \(rank counts "
                                         r"that divide them all: 1, 2, 4, 8\)"):
        shard_heads(32, 8, 3)


def test_a_model_that_does_not_shard_is_refused_before_any_process_starts():
    from mstar_core.demo import TinyDecoder, TinyDecoderConfig

    with pytest.raises(ValueError, match="cannot shard query heads 4, KV heads 2, MLP width 512 over 3 ranks"):
        TinyDecoder(TinyDecoderConfig(), tp=TensorParallel(0, 3))
    with pytest.raises(ValueError, match="MLP width 511 over 2 ranks"):
        TinyDecoder(TinyDecoderConfig(mlp=511), tp=TensorParallel(0, 2))


def test_a_sharded_model_holds_its_slice_of_the_unsharded_weights():
    from mstar_core.demo import TinyDecoder, TinyDecoderConfig

    cfg = TinyDecoderConfig(num_qo_heads=8, num_kv_heads=4)
    whole = TinyDecoder(cfg, seed=3)
    for rank in range(2):
        part = TinyDecoder(cfg, seed=3, tp=TensorParallel(rank, 2))
        assert (part.num_qo_heads, part.num_kv_heads) == (4, 2)
        w, p = whole.layers[1], part.layers[1]
        d = cfg.head_dim
        # query heads 4r..4r+3 read KV heads 2r..2r+1: the GQA groups stay whole on one rank
        assert torch.equal(p["wq"], w["wq"][:, rank * 4 * d:(rank + 1) * 4 * d])
        assert torch.equal(p["wk"], w["wk"][:, rank * 2 * d:(rank + 1) * 2 * d])
        assert torch.equal(p["wo"], w["wo"][rank * 4 * d:(rank + 1) * 4 * d])
        assert torch.equal(p["w2"], w["w2"][rank * cfg.mlp // 2:(rank + 1) * cfg.mlp // 2])
        assert torch.equal(part.embed, whole.embed) and torch.equal(part.head, whole.head)


# -- the demo: sharded equals single-process ----------------------------------------------------

def _demo_rank(rank, timeout_s, diverge):
    from mstar_core.demo import text

    if diverge and rank == 1:  # rank 1's scheduler sees one more prompt token for r0 (same pages)
        real = text.make_requests

        def make_requests(vocab, seed):
            reqs = real(vocab, seed)
            reqs[0].prompt.append(1)
            return reqs

        text.make_requests = make_requests
    heads = []
    real_kv = text.KVManager

    class KV(real_kv):
        def __init__(self, config, *a, **kw):
            heads.append((config.num_kv_heads, config.num_qo_heads))
            super().__init__(config, *a, **kw)

    text.KVManager = KV
    with launched(WORLD, "cpu", "demo", timeout_s) as (tp, _):
        rep = text.run_text_demo(REF_WRAPPERS, "reference", tp=tp)
        return {"ok": rep.ok, "error": rep.max_error, "steps": rep.steps, "waits": rep.waits, "tp": rep.tp,
                "heads": heads, "logits": {k: v.tolist() for k, v in rep.logits.items()}}


@pytest.mark.slow
def test_the_sharded_demo_computes_what_one_process_does():
    from mstar_core.demo.text import run_text_demo

    single = run_text_demo(REF_WRAPPERS, "reference")
    got = run_ranks(_demo_rank, False)
    assert single.ok and single.waits > 0  # the refusal path ran: admissions agreed through it
    for r in range(WORLD):
        kind, rep = got[r]
        assert kind == "ok", rep
        assert rep["ok"] and rep["tp"] == WORLD
        assert rep["heads"] == [(1, 2)]  # each rank's KV cache and attention hold half the heads (2 KV, 4 query)
        assert rep["steps"] == single.steps and rep["waits"] == single.waits
        assert rep["error"] == got[0][1]["error"] <= 1e-3  # rank 0's check, handed to every rank
        assert rep["logits"].keys() == single.logits.keys()
        for rid, want in single.logits.items():
            # float32: the all-reduce sums the shards' partial products in another order
            torch.testing.assert_close(torch.tensor(rep["logits"][rid]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_ranks_that_admit_differently_fail_before_their_collectives_mismatch():
    got = run_ranks(_demo_rank, True)
    for r in range(WORLD):
        kind, msg = got[r]
        assert kind == "error" and "tensor-parallel ranks disagree on step 0's admission tokens: rank" in msg, msg
        assert "ranks range from 22 to 23" in msg and "free pages" not in msg
        assert "admission decisions have diverged" in msg


# -- the bench: the CLI, as torchrun starts it --------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs+preplan"])
def test_bench_tp2_reports_the_all_reduce_share_on_rank_0(graphs):
    argv = ["bench", "--tp", "2", "--layers", "2", "--batch", "2", "--context", "20", "--steps", "3", "--warmup", "1",
            "--json", *(["--graphs", "--preplan"] if graphs else [])]
    got = run_ranks(cli_rank, argv)
    assert got[1] == ("ok", (0, "")), got[1]  # rank 0 prints the table, rank 1 nothing
    kind, (rc, out) = got[0]
    assert kind == "ok" and rc == 0
    res = json.loads(out)
    assert res["tp"] == 2 and res["options"]["tp"] == 2
    assert res["graphs"] is graphs and res["preplan"] is graphs
    assert res["median_step_ms"] > 0 and 0 < res["allreduce_ms"]
    assert res["allreduce_share"] == pytest.approx(res["allreduce_ms"] / res["median_step_ms"])


def _bench_diverging_rank(rank, timeout_s):
    import mstar_core.demo.decode_bench as db

    if rank == 1:  # rank 1's scheduler admits a longer context than rank 0's, from the same pool
        real = db.KVSpan
        db.KVSpan = lambda rid, label, n: real(rid, label, n + 16 if n == 20 else n)
    with launched(WORLD, "cpu", "bench", timeout_s) as (tp, _):
        db.build_decode_setup(db.BenchOptions(tp=2, batch=2, context=20, layers=1), tp)
        return "built"


@pytest.mark.slow
def test_bench_ranks_whose_admissions_differ_fail_post_warmup_validate():
    got = run_ranks(_bench_diverging_rank)
    for r in range(WORLD):
        kind, msg = got[r]
        assert kind == "error" and "ranks disagree on kv free pages" in msg, msg
        assert "kv tokens: rank" in msg and "ranks range from 40 to 72" in msg, msg


# -- a rank failing mid-run -------------------------------------------------------------------

def _failing_demo_rank(rank, timeout_s, how):
    from mstar_core.demo import TinyDecoder
    from mstar_core.demo.text import run_text_demo

    TinyDecoder.forward_step = breaking(TinyDecoder.forward_step, rank, how, timeout_s + 5)
    with launched(WORLD, "cpu", "demo", timeout_s) as (tp, _):
        t0 = time.monotonic()
        try:
            run_text_demo(REF_WRAPPERS, "reference", tp=tp)
        finally:
            if rank == 0:
                print(f"rank 0 ended after {time.monotonic() - t0:.1f} s", file=sys.stderr)
        return "finished"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raises", "stalls"])
def test_a_rank_failing_mid_run_is_a_clear_error_on_the_other_not_a_hang(how):
    timeout_s = 10.0  # also the rendezvous's: two processes importing torch on a busy CI machine
    t0 = time.monotonic()
    got = run_ranks(_failing_demo_rank, how, timeout_s=timeout_s, join_s=90.0)
    assert time.monotonic() - t0 < 75.0
    if how == "raises":
        assert got[1] == ("error", "ValueError: rank 1 breaks at its fourth step")
    kind, msg = got[0]
    assert kind == "error" and msg.startswith("TensorParallelError: rank 0: the ") and "all-reduce failed" in msg, msg
    assert "another rank has failed or stalled" in msg


@pytest.mark.slow
def test_the_stall_watchdog_fires_only_without_progress():
    fired = []
    with StallWatchdog(1.0, "unit", on_stall=fired.append) as dog:
        for _ in range(30):
            time.sleep(0.05)
            dog.pet()
        assert not fired  # petted every 0.05 s: never idle for 1 s
        time.sleep(3.0)
    assert len(fired) == 1 and "unit: no progress" in fired[0] and "after 30 steps" in fired[0]
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        StallWatchdog(0, "unit")


@pytest.mark.slow
def test_the_stall_watchdog_ends_a_hung_process_with_a_clear_error():
    code = ("import time\nfrom mstar_core.distributed import StallWatchdog\n"
            "with StallWatchdog(0.5, 'bench rank 0 of 2'):\n    time.sleep(60)\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert p.returncode == 3
    assert "mstar: bench rank 0 of 2: no progress" in p.stderr and "instead of waiting forever" in p.stderr


@pytest.mark.parametrize(("argv", "want"), [
    (["bench", "--tp", "2"],
     "launch it with torchrun, e.g. `torchrun --nproc-per-node 2 -m mstar_core.cli bench --tp 2"),
    (["demo", "--tp", "2"], "`torchrun --nproc-per-node 2 -m mstar_core.cli demo --tp 2"),
    (["bench", "--tp", "3"], "bench --tp 3: cannot shard query heads 4, KV heads 2, MLP width 512 over 3 ranks"),
    (["demo", "--tp", "3"], "demo --tp 3: cannot shard query heads 4, KV heads 2, MLP width 512 over 3 ranks"),
    (["bench", "--tp", "4", "--hidden", "255", "--qo-heads", "8", "--kv-heads", "4"],
     "(rank counts that divide them all: 1, 2)"),
    (["demo", "--tp", "2", "--workload", "denoise"], "the denoise workload runs on one rank"),
])
def test_tp_cli_errors_name_the_fix(argv, want, capsys, monkeypatch):
    from mstar_core import cli

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert cli.main(argv) == 2
    assert want in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "want"), [
    (["demo", "--tp", "0", "--workload", "denoise"], "--tp: must be a rank count >= 1, got '0'"),
    (["bench", "--tp", "two"], "--tp: must be a rank count >= 1, got 'two'"),
    (["bench", "--tp-timeout", "inf"], "--tp-timeout: must be a finite number of seconds > 0, got 'inf'"),
    (["demo", "--tp-timeout", "0"], "--tp-timeout: must be a finite number of seconds > 0, got '0'"),
])
def test_tp_options_are_checked_when_parsed(argv, want, capsys):
    from mstar_core import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and want in capsys.readouterr().err


def test_tp_1_among_several_processes_warns(caplog, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level("WARNING"), launched(1, "cpu", "bench") as (tp, dev):
        assert tp is None and dev == torch.device("cpu")
    assert "bench --tp 1 in one of 2 processes started together" in caplog.text


@pytest.mark.slow
def test_torchrun_runs_the_demo_on_two_gloo_ranks(tmp_path):
    """The launch the README gives, end to end: rank 0 prints the report once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "mstar_core.cli", "demo", "--tp", "2"], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("backend: reference; tensor parallel over 2 ranks") == 1
    assert p.stdout.count(": OK") == 1
