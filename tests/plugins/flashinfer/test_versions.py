"""Each side of the FlashInfer version guards (mstar_flashinfer/compat.py), through the stand-in
emulating 0.5.3, 0.7.2.post1 and 0.7.4 (the conftest runs every stand-in test on each)."""

from __future__ import annotations

import logging

import pytest
import torch

from mstar_core.testing import conformance as C
from mstar_flashinfer import compat
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper

from ...helpers import REPO, case, err, oracle, shifted

WS = torch.empty(1024, dtype=torch.uint8)
F32 = torch.float32
CPU = torch.device("cpu")


def _graph_prefill(tokens=64, batch=4, pages=64):
    return FlashInferPrefillWrapper(WS, 4, 2, 16, 4, batch_size=batch, max_total_tokens=tokens, max_num_pages=pages,
                                    device=CPU, accelerator_graph=True)


def test_graph_token_budget_is_set_up_front_the_way_the_release_offers(standin_flashinfer):
    w = _graph_prefill(tokens=64)
    new_ctor = standin_flashinfer.__version__ == "0.7.4"
    assert compat.takes_row_budget(type(w._inner)) is new_ctor
    assert w._inner._max_total_num_rows == 64  # by the constructor (0.7.4) or the attribute (before)
    # so a first plan with few tokens does not refuse a larger one later
    for q_lens in ((2, 1), (30, 20, 10, 4)):
        c = case(q_lens, (3,) * len(q_lens), seed=len(q_lens))
        d = shifted(C.make_paged(c, "cpu", F32), 1)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
        assert err(w.run(d.q, d.layer), oracle(c, d)) < 2e-5


def test_a_release_without_either_budget_path_is_named_in_a_warning(caplog):
    class Bare:  # neither the 0.7.4 constructor argument nor the private attribute
        def __init__(self, workspace, layout, **kw):
            pass

    with caplog.at_level(logging.WARNING, logger="mstar.flashinfer"):
        compat.graph_prefill(Bare, 64, WS, "NHD", use_cuda_graph=True)
    assert "Bare takes neither max_total_num_rows nor _max_total_num_rows" in caplog.text


def test_static_run_over_a_smaller_plan_passes_the_row_check_only_where_there_is_one(standin_flashinfer):
    w = _graph_prefill(tokens=48)
    c = case((5, 1, 9), (0, 7, 2), seed=4)
    d = shifted(C.make_paged(c, "cpu", F32), 1)
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    n = d.q.shape[0]
    checks = standin_flashinfer.__version__ != "0.5.3"
    assert compat.checks_q_rows(w._inner) is checks
    if checks:  # the plan's own count until a static run
        assert w._inner._qo_indptr_last == n
    q_static = torch.randn(48, 4, 16)
    q_static[:n] = d.q
    out = w.run(q_static, d.layer)
    assert out.shape[0] == 48 and err(out[:n], oracle(c, d)) < 2e-5
    if checks:
        assert w._inner._qo_indptr_last == 48
    # a run of the planned size right after a static one, on the same plan, passes too
    assert err(w.run(d.q, d.layer), oracle(c, d)) < 2e-5
    if checks:
        assert w._inner._qo_indptr_last == n
    assert err(w.run(q_static, d.layer)[:n], oracle(c, d)) < 2e-5


def test_the_0_7_row_check_is_real_in_the_stand_in(standin_flashinfer):
    """The guard above is needed: FlashInfer 0.7's own wrapper refuses the static q."""
    if standin_flashinfer.__version__ == "0.5.3":
        pytest.skip("0.5.3 has no row check")
    w = _graph_prefill(tokens=48)
    c = case((5, 1), (0, 7), seed=5)
    d = shifted(C.make_paged(c, "cpu", F32), 1)
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    with pytest.raises(ValueError, match=r"q.shape\[0\] \(48\) does not match qo_indptr\[-1\] \(6\)"):
        w._inner.run(torch.randn(48, 4, 16), d.layer)


@pytest.mark.parametrize("q_lens,prefix", [((1, 9, 1, 6), (12, 0, 4, 3)), ((1, 1, 1), (3, 9, 0))],
                         ids=["mixed", "one-token-rows-only"])
def test_mixed_eager_hands_the_prefill_half_exactly_its_prompt_tokens(standin_flashinfer, q_lens, prefix):
    c = case(q_lens, prefix, seed=6)
    d = shifted(C.make_paged(c, "cpu", F32), 1)
    w = FlashInferMixedWrapper(WS, WS, 4, 2, 16, 4, 6, 48, 64, 2, CPU)
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_lens=d.kv_lens)
    seen = []
    inner_run = w._pre._inner.run
    w._pre._inner.run = lambda q, *a, **k: seen.append(q.shape[0]) or inner_run(q, *a, **k)
    assert err(w.run(d.q, d.layer), oracle(c, d)) < 2e-5
    prompt_tokens = sum(n for n in q_lens if n > 1)
    assert seen == ([prompt_tokens] if prompt_tokens else [])  # none at all when no row is a prompt row
    # a static q (the bucket's 48 rows) goes whole to the prefill half, on every release
    seen.clear()
    q_static = torch.randn(48, 4, 16)
    q_static[: d.q.shape[0]] = d.q
    assert err(w.run(q_static, d.layer)[: d.q.shape[0]], oracle(c, d)) < 2e-5
    assert seen == [48]
    # and an eager run after it, on the same plan, again hands over exactly the prompt tokens
    seen.clear()
    assert err(w.run(d.q, d.layer), oracle(c, d)) < 2e-5
    assert seen == ([prompt_tokens] if prompt_tokens else [])


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_runs_hand_flashinfer_an_output_so_0_7_does_not_zero_fill_one(standin_flashinfer, kind):
    c = case((3, 2) if kind == "prefill" else (1, 1), (4, 5), seed=7)
    d = C.make_paged(c, "cpu", F32)
    if kind == "prefill":
        w = FlashInferPrefillWrapper(WS, 4, 2, 16, 4, device=CPU)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    else:
        w = FlashInferDecodeWrapper(WS, 4, 2, 16, 4, device=CPU)
        w.plan(d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    outs = []
    inner_run = w._inner.run
    w._inner.run = lambda q, kv, **k: outs.append(k.get("out")) or inner_run(q, kv, **k)
    got = w.run(d.q, d.layer)
    assert outs and outs[0] is not None and outs[0].data_ptr() == got.data_ptr()
    assert err(got, oracle(c, d)) < 2e-5


@pytest.mark.parametrize("installed,warned", [("0.5.3", False), ("0.7.2.post1", False), ("0.7.4", False),
                                              ("0.7.4.post1", True), ("0.7.5", True), ("0.8.0rc1", True)])
def test_a_release_newer_than_the_verified_range_runs_with_a_warning(monkeypatch, caplog, installed, warned):
    from mstar_flashinfer import probe

    monkeypatch.setattr(probe, "module_missing", lambda *a: [])
    monkeypatch.setattr(probe, "version_too_old", lambda *a: [])
    monkeypatch.setattr(probe, "installed_version", lambda d: ("flashinfer-python", installed))
    with caplog.at_level(logging.WARNING, logger="mstar.flashinfer"):
        assert probe.probe(CPU) == []
    assert ("newer than the newest release verified with mstar-flashinfer (0.7.4" in caplog.text) is warned


def test_the_declared_range_is_the_verified_one():
    import tomllib

    from mstar_flashinfer import probe

    meta = tomllib.loads((REPO / "plugins/flashinfer/pyproject.toml").read_text())
    assert probe.INSTALL in meta["project"]["dependencies"]
    assert probe.INSTALL == f"flashinfer-python>={compat.VERIFIED[0]},<={compat.VERIFIED[-1]}"


def test_graph_prefill_resolves_auto_up_front_where_a_first_plan_would_fix_it(standin_flashinfer):
    """0.7.4 chooses fa2/fa3 per plan, but a graph-mode wrapper keeps its first plan's choice:
    a first plan of short prompts would put every later long prompt on fa2. Resolved at build."""
    w = _graph_prefill(tokens=128)
    per_plan = standin_flashinfer.__version__ == "0.7.4"
    assert w._inner._backend == ("fa2" if per_plan else "auto")  # FlashInfer's own rule; a CPU is not sm90
    assert w._per_plan_backend is False  # one backend for the wrapper's life: one first use
    eager = FlashInferPrefillWrapper(WS, 4, 2, 16, 4, device=CPU)
    assert eager._inner._backend == "auto" and eager._per_plan_backend is per_plan


def test_the_0_7_4_graph_lock_is_real_in_the_stand_in(standin_flashinfer):
    if standin_flashinfer.__version__ != "0.7.4":
        pytest.skip("only 0.7.4 chooses per plan")
    raw = standin_flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        WS, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(3, dtype=torch.int32),
        paged_kv_indptr_buf=torch.zeros(3, dtype=torch.int32), paged_kv_indices_buf=torch.zeros(64, dtype=torch.int32),
        paged_kv_last_page_len_buf=torch.ones(2, dtype=torch.int32), max_total_num_rows=256)
    assert raw._plan_backend(torch.tensor([0, 8, 16])) == "fa2"
    assert raw._plan_backend(torch.tensor([0, 100, 200])) == "fa2"  # locked by the first plan
