"""``mstar warmup`` for FlashInfer through the stand-in, whose plans "build" each module they need
into the JIT folder the first time (tests/standins/flashinfer: build_module): after a warm-up, a
first plan and run of every wrapper builds nothing, and the first-use notice says so."""

from __future__ import annotations

import logging

import pytest
import torch

from mstar_core import WarmupConfig, first_use
from mstar_core.testing import conformance as C
from mstar_flashinfer import jit_notice
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.warmup import warmup

from ...helpers import case

CPU = torch.device("cpu")
F32 = torch.float32
CAPS = ("paged_prefill", "paged_decode", "mixed", "prefixed_ragged")


def _cfg(**kw):
    base = dict(dtype=F32, head_dim=16, page_size=4, num_qo_heads=4, num_kv_heads=2)
    return WarmupConfig(**{**base, **kw})


def test_warmup_builds_each_variant_once_and_a_second_warmup_builds_nothing(standin_flashinfer):
    cfg = _cfg(windows=(-1, 8))
    first = warmup(cfg, CPU, CAPS)
    n = 6 if standin_flashinfer.__version__ == "0.7.4" else 4
    assert first[-1].startswith(
        f"FlashInfer compiled {n} module(s) here; its prebuilt-kernel package flashinfer-jit-cache")
    first = first[:-1]
    # per window: decode once, the others for short and long queries
    assert [(k.capability, k.variant) for k in first][:7] == [
        ("paged_prefill", "full, short queries"), ("paged_prefill", "full, long queries"),
        ("paged_decode", "full"), ("mixed", "full, short queries"), ("mixed", "full, long queries"),
        ("prefixed_ragged", "full, short queries"), ("prefixed_ragged", "full, long queries")]
    assert len(first) == 14
    built = jit_notice.built_modules(jit_notice.jit_dir())
    # prefill and decode (4 q / 2 KV heads: no tensor cores), each with and without window; on 0.7.4 the
    # long-query prefill plans run fa3, a module of their own (the short ones and ragged stay on fa2)
    fa3 = {m for m in built if m.endswith("_sm90")}
    assert len(fa3) == (2 if standin_flashinfer.__version__ == "0.7.4" else 0)
    assert len(built - fa3) == 4 and all("use_swa_True" in m or "use_swa_False" in m for m in built)
    assert first[0].detail.startswith("compiled 1 module: batch_prefill_with_kv_cache_dtype_q_f32")
    assert "use_swa_True" in first[7].detail  # the first windowed variant builds the windowed module
    again = warmup(cfg, CPU, CAPS)
    assert all(k.detail.startswith("nothing compiled") for k in again)  # and no note: nothing was compiled


def test_after_warmup_a_first_plan_and_run_builds_nothing_and_says_so(standin_flashinfer, caplog):
    warmup(_cfg(), CPU, ("paged_prefill", "paged_decode"))
    before = jit_notice.built_modules(jit_notice.jit_dir())
    first_use.forget()  # as a new process would
    c = case((3, 70), (5, 2), head_dim=16, gqa=2)  # a long query: the variant 0.7.4 runs on fa3
    d = C.make_paged(c, "cpu", F32)
    with caplog.at_level(logging.INFO, logger="mstar.flashinfer"):
        w = FlashInferPrefillWrapper(torch.empty(8, dtype=torch.uint8), 4, 2, 16, 4, device=CPU)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
        w.run(d.q, d.layer)
        dec = FlashInferDecodeWrapper(torch.empty(8, dtype=torch.uint8), 4, 2, 16, 4, device=CPU)
        dd = C.make_paged(case((1, 1), (5, 9), head_dim=16, gqa=2), "cpu", F32)
        dec.plan(dd.kv_indptr, dd.kv_indices, dd.last_page_len, dtype=F32)
    assert jit_notice.built_modules(jit_notice.jit_dir()) == before
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("FlashInfer paged prefill kernels (float32, head_dim 16")
               and "first use in this process" in m for m in lines)
    assert any("ready in" in m and "nothing compiled" in m for m in lines)


def test_a_first_use_that_compiles_names_the_module_and_is_announced_once(standin_flashinfer, caplog):
    c = case((2, 3), (1, 4), head_dim=16, gqa=2, window_left=3)
    d = C.make_paged(c, "cpu", F32)
    w = FlashInferPrefillWrapper(torch.empty(8, dtype=torch.uint8), 4, 2, 16, 4, device=CPU)
    with caplog.at_level(logging.INFO, logger="mstar.flashinfer"):
        for _ in range(3):
            w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, window_left=3)
    msgs = [r.getMessage() for r in caplog.records]
    assert len([m for m in msgs if "first use" in m]) == 1
    (ready,) = [m for m in msgs if "ready in" in m]
    assert "sliding window" in ready and "compiled 1 module: batch_prefill" in ready and "use_swa_True" in ready


def test_a_failed_first_use_is_announced_again(standin_flashinfer, caplog):
    w = FlashInferPrefillWrapper(torch.empty(8, dtype=torch.uint8), 4, 2, 16, 4, device=CPU)
    c = case((2,), (1,), head_dim=16, gqa=2)
    d = C.make_paged(c, "cpu", F32)
    inner_plan = w._inner.plan
    w._inner.plan = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("nvcc failed"))
    with caplog.at_level(logging.INFO, logger="mstar.flashinfer"):
        with pytest.raises(RuntimeError, match="nvcc failed"):
            w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
        w._inner.plan = inner_plan
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    assert len([r for r in caplog.records if "first use" in r.getMessage()]) == 2


def test_no_prebuilt_note_where_flashinfer_jit_cache_is_installed(standin_flashinfer, monkeypatch):
    import importlib.util

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashinfer_jit_cache" else real_find(name, *a))
    got = warmup(_cfg(), CPU, ("paged_decode",))
    assert [k.detail.split(":")[0] for k in got] == ["compiled 1 module"]


def test_the_dense_path_is_warmed_without_soft_cap_which_it_never_uses(standin_flashinfer):
    got = warmup(_cfg(soft_cap=30.0), CPU, ("prefixed_ragged",))
    assert [k.variant for k in got[:2]] == ["full, short queries", "full, long queries"]
    assert "use_logits_cap_False" in got[0].detail


def test_the_sink_variant_built_at_its_first_plan_is_announced(standin_flashinfer, caplog):
    """The sink-logit variant's module is built as its wrapper is made (a compile on a GPU): that
    first use is announced once, as every other kernel family's."""
    first_use.forget()
    dd = C.make_paged(case((1, 1), (5, 9), head_dim=16, gqa=2), "cpu", F32)
    dec = FlashInferDecodeWrapper(torch.empty(8, dtype=torch.uint8), 4, 2, 16, 4, device=CPU)
    with caplog.at_level(logging.INFO, logger="mstar.flashinfer"):
        for _ in range(2):
            dec.plan(dd.kv_indptr, dd.kv_indices, dd.last_page_len, dtype=F32, sink_logits=True)
    msgs = [m for m in (r.getMessage() for r in caplog.records) if "first use" in m]
    assert any(m.startswith("FlashInfer paged attention (sink logits) kernels (float32, head_dim 16") for m in msgs)
    assert len([m for m in msgs if "sink logits" in m]) == 2  # the variant's build, then its decode plan; once each
