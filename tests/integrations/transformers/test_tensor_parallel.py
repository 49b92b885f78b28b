"""transformers models over two gloo ranks (CPU processes, float32, reference backend): loaded
sharded by transformers' tensor parallelism, or held whole and sharded by mstar, they generate
the ids of the single-process run; ranks whose weights or admissions differ fail loudly on every
rank; a rank failing or stalling mid-run is a clear error on the other, not a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from mstar_core import (
    Engine,
    EngineOptions,
    StateError,
    TensorParallel,
    TensorParallelError,
    generate,
    generate_report,
)
from mstar_core.cli.parallel import launched
from mstar_core.integrations.transformers import run
from mstar_core.integrations.transformers.parallel import model_sharding, shard
from mstar_core.testing.hf_models import build

from ...ranks import WORLD, breaking, cli_rank, run_ranks

NEW = 12
LENGTHS = (1, 16, 17, 30, 5)
ARRIVALS = [0, 0, 1, 3, 5]
# Qwen3's tiny model has one KV head; two shard over two ranks.
OVERRIDES = {"llama": {}, "qwen3": {"num_key_value_heads": 2}}


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _saved(arch: str, directory: str) -> str:
    """A tiny model of ``arch`` saved with safetensors weights (what from_pretrained shards)."""
    model = build(arch, **OVERRIDES[arch])
    model.save_pretrained(directory)
    return directory


def _load(directory: str, sharded: bool):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    extra = {"distributed_config": DistributedConfig(tp_size=WORLD)} if sharded else {}
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **extra).eval()


def _runs(model, tp):
    """What each rank reports of one model: greedy ids with joining requests and the graph path,
    its KV heads, and sampled ids without seeds (drawn with rank 0's)."""
    ps = _prompts(model.config.vocab_size)
    with Engine(model, "reference", EngineOptions(max_pages=64, max_batch_size=8, graphs=True), tp=tp) as engine:
        heads = (engine.kv.config.num_kv_heads, engine.kv.config.num_qo_heads)
        greedy = run(engine, ps, NEW, arrivals=ARRIVALS).ids
    from mstar_core import SamplingParams

    sampled = generate(model, ps, NEW, backend="reference", tp=tp, eos_token_id=None,
                       sampling=SamplingParams(temperature=1.0, top_k=20))
    w = model.model.layers[0].self_attn.q_proj.weight
    w = w.to_local() if hasattr(w, "to_local") else w
    return {"greedy": greedy, "heads": heads, "sampled": sampled, "numel": w.numel() * w.element_size(),
            "storage": w.untyped_storage().nbytes()}


def _generate_rank(rank, timeout_s, directory):
    torch.manual_seed(rank)  # each rank's own default generator differs: seeds must come from rank 0
    with launched(WORLD, "cpu", "test", timeout_s) as (tp, _):
        by_transformers = _load(directory, sharded=True)
        assert model_sharding(by_transformers).by == "transformers"
        out = {"transformers": _runs(by_transformers, None)}  # None: the group it was loaded over
        whole = _load(directory, sharded=False)
        out["mstar"] = _runs(whole, WORLD)
        assert model_sharding(whole).by == "mstar" and model_sharding(whole).tp == tp
        return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_generate_the_single_process_ids(arch, tmp_path):
    directory = _saved(arch, str(tmp_path / arch))
    model = _load(directory, sharded=False)
    ps = _prompts(model.config.vocab_size)
    want = generate_report(model, ps, NEW, backend="reference", arrivals=ARRIVALS, max_pages=64)
    assert want.kinds["mixed"] >= 1 and all(len(x) == NEW for x in want.ids)
    q, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    got = run_ranks(_generate_rank, directory, join_s=240.0)
    for r in range(WORLD):
        kind, res = got[r]
        assert kind == "ok", res
        for by in ("transformers", "mstar"):
            assert res[by]["greedy"] == want.ids, f"rank {r}, sharded by {by}: ids differ from one process's"
            assert res[by]["heads"] == (kv // WORLD, q // WORLD)  # each rank's cache holds its KV heads
            assert res[by]["sampled"] != res[by]["greedy"]  # drawn, not argmax, with rank 0's seeds on both
            assert res[by]["storage"] == res[by]["numel"]  # a shard holds its slice's memory only


# -- ranks that differ ----------------------------------------------------------------------------

def _diverging_rank(rank, timeout_s):
    """What each rank raised when the ranks differ: in their weights (rank 1 built its random
    model from another seed), their prompts (one token), their admissions (rank 1's scheduler
    defers a prompt); and for a backend that does not exist, with the model left whole."""
    from mstar_core.integrations.transformers import batching

    raised = {}

    def whole(model):
        return model_sharding(model) is None and model.model.layers[0].self_attn.q_proj.weight.shape[0] == 8 * 64

    with launched(WORLD, "cpu", "test", timeout_s) as (tp, _):
        model = build("llama", seed=rank)
        with pytest.raises(StateError) as e:
            generate(model, [[1, 2, 3]], 4, backend="reference", tp=WORLD)
        raised["weights"] = (str(e.value), whole(model))
        model = build("llama")
        with pytest.raises(ValueError) as e:
            generate(model, [[1, 2, 3]], 4, backend="no-such-backend", tp=WORLD)
        raised["backend"] = (str(e.value), whole(model))
        with pytest.raises(StateError) as e:
            generate(model, [[1, 2, 3], [4, 5, 9 if rank else 6]], 4, backend="reference", tp=WORLD)
        raised["prompts"] = (str(e.value), whole(model))
        if rank == 1:
            real = batching._Loop._joining
            batching._Loop._joining = lambda self, decode: real(self, decode)[:-1] if self.step_no == 0 else \
                real(self, decode)
        with pytest.raises(StateError) as e:
            generate(model, [[1, 2, 3], [4, 5, 6]], 4, backend="reference", tp=WORLD)
        raised["admissions"] = (str(e.value), whole(model))
    return raised


@pytest.mark.slow
def test_ranks_that_differ_fail_on_every_rank():
    got = run_ranks(_diverging_rank)
    for r in range(WORLD):
        kind, raised = got[r]
        assert kind == "ok", raised
        said = {k: v[0] for k, v in raised.items()}
        assert [k for k, (_, left_whole) in raised.items() if left_whole] == ["weights", "backend"], raised
        assert "the ranks hold different weights" in said["weights"], said
        assert "every rank must load the same model" in said["weights"]
        assert "no-such-backend" in said["backend"], said
        assert "ranks disagree on the requests prompts: rank" in said["prompts"], said
        assert "every rank must generate for the same prompts" in said["prompts"]
        assert "ranks disagree on step 0's admission rows: rank" in said["admissions"], said
        assert "range from 1 to 2" in said["admissions"] and "admission decisions have diverged" in said["admissions"]


# -- a rank failing mid-run ---------------------------------------------------------------------

def _failing_rank(rank, timeout_s, directory, how):
    # stalls: 20 s in a step, past the engine's tp_timeout_s of 1 s plus the watchdog's grace of 10 s,
    # well inside the group's timeout: no collective would notice before the watchdog.
    Engine._forward = breaking(Engine._forward, rank, how, 20.0)
    with launched(WORLD, "cpu", "test", timeout_s) as (tp, _):
        if how == "raises":  # the model transformers sharded: its own all-reduces notice the peer
            generate(_load(directory, sharded=True), [[1, 2, 3], [4, 5]], 16, backend="reference")
        else:  # mstar's sharding; the stall watchdog ends the ranks
            generate(build("llama"), [[1, 2, 3], [4, 5]], 16, backend="reference", tp=WORLD, tp_timeout_s=1.0)
        return "finished"


@pytest.mark.slow
def test_a_rank_failing_mid_run_is_a_clear_error_on_the_other_not_a_hang(tmp_path):
    directory = _saved("llama", str(tmp_path / "llama"))
    got = run_ranks(_failing_rank, directory, "raises", timeout_s=10.0, join_s=120.0)
    assert got[1] == ("error", "ValueError: rank 1 breaks at its fourth step")
    kind, msg = got[0]
    assert kind == "error" and msg.startswith("TensorParallelError: rank 0: step 3 failed (RuntimeError: ["), msg
    assert "/gloo/" in msg and "another rank has failed or stalled" in msg, msg


@pytest.mark.slow
def test_a_stalled_rank_ends_every_rank_within_the_engines_timeout(capfd):
    t0 = time.monotonic()
    got = run_ranks(_failing_rank, None, "stalls", timeout_s=60.0, join_s=90.0)
    assert time.monotonic() - t0 < 40.0  # the group's own timeout (60 s) never came
    assert got == {}  # both ranks ended themselves (exit status 3) instead of returning
    err = capfd.readouterr().err
    for r in range(WORLD):
        assert f"mstar: generate rank {r} of 2: no progress for" in err and "(timeout 11 s)" in err, err[-2000:]
    assert "another tensor-parallel rank has failed or stalled" in err


# -- the CLI, as torchrun starts it ---------------------------------------------------------------

@pytest.mark.slow
def test_torchrun_generate_tp2_prints_the_single_process_ids_once(tmp_path, capsys):
    from mstar_core import cli

    directory = _saved("llama", str(tmp_path / "llama"))
    argv = ["generate", directory, "--ids", "--prompt", "1,2,3", "--prompt", "4 5 6 7 8", "--max-new-tokens", "6",
            "--backend", "reference"]
    assert cli.main([*argv, "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["ids"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "mstar_core.cli", *argv, "--tp", "2", "--json"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)  # one JSON object: rank 1 printed nothing
    assert out["ids"] == want and out["tp"] == 2 and out["sharded_by"] == "transformers"


@pytest.mark.slow
def test_generate_tp2_shards_random_weights_itself(tmp_path, capsys):
    from mstar_core import cli

    directory = tmp_path / "config-only"
    build("qwen3", **OVERRIDES["qwen3"]).config.save_pretrained(directory)  # no weights: random from --seed
    argv = ["generate", str(directory), "--ids", "--prompt", "1,2,3", "--prompt", "9", "--max-new-tokens", "6",
            "--backend", "reference", "--seed", "3"]
    assert cli.main([*argv, "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["ids"]
    got = run_ranks(cli_rank, [*argv, "--tp", "2"])
    assert got[1] == ("ok", (0, ""))  # rank 0 prints, rank 1 nothing
    kind, (rc, out) = got[0]
    assert kind == "ok" and rc == 0
    assert "tensor parallel: 2 ranks, the heads sharded by mstar" in out
    lines = [x for x in out.splitlines() if x.startswith("[0] ") or x.startswith("[1] ")]
    # each ids line ends with its finish (no tokenizer: no text line)
    assert [x.split(" (finish: ")[0] for x in lines] == [f"[{i}] {' '.join(map(str, ids))}"
                                                         for i, ids in enumerate(want)]


# -- refused in one process -----------------------------------------------------------------------

def test_tp_values_are_checked_before_anything_changes(monkeypatch):
    model = build("llama")
    q_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    with pytest.raises(TypeError, match="tp must be a rank count, a TensorParallel or None"):
        generate(model, [[1]], 2, tp="2")
    with pytest.raises(ValueError, match="tp must be a rank count >= 1, got 0"):
        generate(model, [[1]], 2, tp=0)
    with pytest.raises(ValueError, match=r"cannot shard query heads 8, KV heads 2 over 3 ranks: .*\(rank counts that "
                                         r"divide them all: 1, 2\)"):
        generate(model, [[1]], 2, tp=3)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        generate(model, [[1]], 2, tp=2)
    with pytest.raises(ValueError, match="tp_timeout_s must be a finite number of seconds > 0"):
        generate(model, [[1]], 2, tp_timeout_s=0)
    monkeypatch.setattr(type(model), "tp_plan", property(lambda self: {}))
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        shard(model, TensorParallel(0, 2))
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == q_rows and model_sharding(model) is None
    assert generate(model, [[1, 2]], 3, backend="reference", tp=1) == generate(model, [[1, 2]], 3, backend="reference")


def test_a_plan_style_mstar_does_not_apply_is_refused_naming_it(monkeypatch):
    model = build("llama")
    plan = {**model.tp_plan, "model.layers.*.mlp.gate_proj": "packed_colwise"}
    monkeypatch.setattr(type(model), "tp_plan", property(lambda self: plan))
    with pytest.raises(ValueError, match=r"tp_plan uses styles \['packed_colwise'\].*distributed_config="
                                         r"DistributedConfig\(tp_size=N\)"):
        shard(model, TensorParallel(0, 2))


@pytest.mark.parametrize(("heads", "argv", "want"), [
    ({}, ["--tp", "2"],
     "launch it with torchrun, e.g. `torchrun --nproc-per-node 2 -m mstar_core.cli generate DIR --tp 2"),
    ({}, ["--tp", "3"], "generate --tp 3: cannot shard query heads 8, KV heads 2 over 3 ranks"),
    # SmolLM2-135M's layout: 9 query / 3 KV heads shard over 3 ranks, not 2
    ({"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 16, "hidden_size": 144}, ["--tp", "2"],
     "generate --tp 2: cannot shard query heads 9, KV heads 3 over 2 ranks: each must be a multiple of the rank "
     "count (rank counts that divide them all: 1, 3)"),
])
def test_generate_tp_cli_errors_name_the_fix(heads, argv, want, tmp_path, capsys, monkeypatch):
    from mstar_core import cli

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    build("llama", **heads).config.save_pretrained(tmp_path)
    assert cli.main(["generate", str(tmp_path), "--ids", "--prompt", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert want in err and "Traceback" not in err


def test_errors_of_a_failed_peer_are_tensor_parallel_errors():
    from mstar_core.distributed import is_collective_failure, peer_failed

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert is_collective_failure(gloo) and not is_collective_failure(RuntimeError("CUDA out of memory"))
    err = peer_failed(1, "step 3", gloo)
    assert isinstance(err, TensorParallelError)
    assert str(err).startswith("rank 1: step 3 failed (RuntimeError: [/pytorch/third_party/gloo/")
