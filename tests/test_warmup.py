"""mstar_core.warmup, ``mstar warmup``, the first-use notice and the CLI's progress line."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest
import torch

from mstar_core import (
    BackendSpec,
    WarmedKernel,
    WarmupConfig,
    first_use,
    get_registry,
    reset_registry,
    warmup,
)
from mstar_core.cli import main
from mstar_core.cli.progress import Progress


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("MSTAR_ATTENTION_BACKEND", raising=False)
    reset_registry()
    first_use.forget()
    yield
    reset_registry()
    first_use.forget()


@pytest.mark.parametrize("kw,match", [
    (dict(head_dim=0), "head_dim must be a positive integer"),
    (dict(num_qo_heads=6, num_kv_heads=4), "not a multiple"),
    (dict(windows=()), "windows must hold"),
    (dict(windows=(-2,)), "windows must hold"),
    (dict(soft_cap=0.0), r"soft_cap must be a finite float > 0, within float32's normal range .* got 0\.0"),
    (dict(soft_cap=float("inf")), r"soft_cap must be a finite float > 0.* got inf"),
    (dict(soft_cap=1e-40), r"soft_cap must be a finite float > 0.* got 1e-40"),
    (dict(page_size=True), "page_size must be a positive integer"),
])
def test_config_refuses_bad_values_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        WarmupConfig(**kw)


def test_windows_are_deduplicated_and_described():
    cfg = WarmupConfig(windows=(4096, -1, 4096), soft_cap=30)
    assert cfg.windows == (-1, 4096)
    assert "windows full, 4096" in cfg.describe() and "soft-cap 30" in cfg.describe()


def test_a_backend_without_warmup_has_nothing_to_prepare():
    rep = warmup(WarmupConfig(torch.float32, 16, 4, 4, 2), "reference", "cpu")
    assert rep.kernels == ()
    assert rep.notes == ("reference (paged_prefill, paged_decode, mixed): nothing to prepare; it compiles nothing on "
                         "first use",
                         "reference (prefixed_ragged): nothing to prepare; it compiles nothing on first use")


def test_a_declared_warmup_gets_the_config_and_the_capabilities_the_backend_provides():
    calls = []

    def fake_warmup(cfg, device, caps):
        calls.append((cfg, device, caps))
        return [WarmedKernel("jitty", c, "full", 0.5, "compiled 1 module: m") for c in caps]

    get_registry().register(BackendSpec(
        name="jitty", provides={"paged_decode": "mstar_core.backends.reference.paged:ReferenceDecodeWrapper"},
        devices=("cpu",), dtypes=(torch.float32,), warmup=fake_warmup))
    cfg = WarmupConfig(torch.float32, 16, 4, 4, 2)
    rep = warmup(cfg, "jitty", "cpu")
    assert calls == [(cfg, torch.device("cpu"), ("paged_decode",))]
    assert [k.capability for k in rep.kernels] == ["paged_decode"] and rep.seconds == 0.5
    with pytest.raises(ValueError, match="provides none of prefixed_ragged"):
        warmup(cfg, "jitty", "cpu", capabilities=("prefixed_ragged",))
    with pytest.raises(ValueError, match="capabilities to warm must be a non-empty subset"):
        warmup(cfg, "jitty", "cpu", capabilities=("paged_decod",))
    with pytest.raises(ValueError, match="bounded compiles nothing on first use"):
        warmup(cfg, "jitty", "cpu", capabilities=("bounded",))


def test_cli_warmup_text_and_json(capsys):
    assert main(["warmup", "--device", "cpu", "--backend", "reference", "--dtype", "float32", "--window", "-1",
                 "--window", "128", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("warm-up for float32, head_dim 64, page 16, 32/8 heads, windows full, 128 on cpu:")
    assert main(["warmup", "--device", "cpu", "--backend", "reference", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["config"]["dtype"] == "bfloat16" and res["kernels"] == [] and len(res["notes"]) == 2


def test_cli_warmup_refuses_a_backend_that_cannot_run_here(capsys):
    assert main(["warmup", "--device", "cpu", "--backend", "nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err


def test_first_use_logs_once_tells_listeners_and_retries_after_a_failure(caplog):
    events = []

    class L:
        def start(self, what):
            events.append(("start", what))
            return len(events)

        def end(self, handle, what, seconds, ok, detail):
            events.append(("end", handle, what, ok, detail))

    li = L()
    first_use.add_listener(li)
    try:
        with caplog.at_level(logging.INFO, logger="mstar.first_use"):
            with pytest.raises(RuntimeError):
                with first_use.first_use("k", "kernel K", "it compiles"):
                    raise RuntimeError("boom")
            for _ in range(2):
                with first_use.first_use("k", "kernel K", "it compiles", detail=lambda: "compiled 1 module: k"):
                    pass
    finally:
        first_use.remove_listener(li)
    assert events == [("start", "kernel K"), ("end", 1, "kernel K", False, None),
                      ("start", "kernel K"), ("end", 3, "kernel K", True, "compiled 1 module: k")]
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs.count("kernel K: first use in this process; it compiles") == 2
    assert sum("ready in" in m and "compiled 1 module: k" in m for m in msgs) == 1


def test_a_detail_that_fails_does_not_fail_the_call_nor_strand_the_progress_line():
    out = io.StringIO()
    p = Progress(out, delay=0.01, every=0.01)
    first_use.add_listener(p)
    try:
        with first_use.first_use("k2", "kernel K2", "why", detail=lambda: 1 / 0):
            time.sleep(0.05)
    finally:
        first_use.remove_listener(p)
    assert first_use.seen("k2")
    assert out.getvalue().splitlines()[-1].startswith("mstar: kernel K2: ready in")
    settled = out.getvalue()
    time.sleep(0.05)
    assert out.getvalue() == settled  # the ticker ended with the call


def test_forget_announces_the_next_use_again(caplog):
    with caplog.at_level(logging.INFO, logger="mstar.first_use"):
        for _ in range(2):
            with first_use.first_use("k3", "kernel K3", "why"):
                pass
            first_use.forget()
    assert sum("kernel K3: first use" in r.getMessage() for r in caplog.records) == 2


def test_progress_is_silent_for_a_quick_first_use_and_counts_a_slow_one():
    quick = io.StringIO()
    p = Progress(quick, delay=0.5, every=0.05)
    t = p.start("fast kernel")
    p.end(t, "fast kernel", 0.01, True, "nothing compiled")
    assert quick.getvalue() == ""
    slow = io.StringIO()
    p = Progress(slow, delay=0.02, every=0.02)
    t = p.start("slow kernel")
    time.sleep(0.15)
    p.end(t, "slow kernel", 0.15, True, "compiled 1 module: m")
    lines = slow.getvalue().splitlines()
    assert len(lines) >= 3 and lines[0].startswith("mstar: preparing slow kernel (first use; it may be compiling)")
    assert lines[-1] == "mstar: slow kernel: ready in 0.1 s (compiled 1 module: m)"


def test_progress_keeps_overlapping_first_uses_apart_and_says_failed():
    out = io.StringIO()
    p = Progress(out, delay=0.01, every=0.01)
    a, b = p.start("A"), p.start("B")
    time.sleep(0.05)
    p.end(a, "A", 0.05, False, None)
    p.end(b, "B", 0.05, True, None)
    assert not a.thread.is_alive() and not b.thread.is_alive()
    text = out.getvalue()
    assert "mstar: A: failed after 0.1 s" in text and "mstar: B: ready in 0.1 s" in text
    settled = out.getvalue()
    time.sleep(0.05)
    assert out.getvalue() == settled  # no ticker left writing


# -- nothing warmed is not a success; selection judges the windows asked for ------------------------

def test_warmup_on_a_device_no_backend_runs_on_raises_naming_why(monkeypatch):
    """A CUDA build of torch that sees no GPU: no group has a backend, so nothing is warmed."""
    from mstar_core.errors import BackendUnavailable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable, match=r"warmup: nothing was warmed on cuda:0: no attention backend can "
                                                 r"run here .* no GPU is usable here.*; device cpu runs the reference"):
        warmup(WarmupConfig(), "auto", "cuda")


def test_cli_warmup_without_a_gpu_exits_2_having_warmed_nothing(capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["warmup"]) == 2  # the default --device cuda
    cap = capsys.readouterr()
    assert cap.out == "" and "warm-up for" not in cap.err
    assert "mstar warmup: error: warmup: --device cuda:" in cap.err and "use --device cpu" in cap.err


def _register_no_windows_backend():
    """A plugin backend auto tries before the reference, declaring no features."""
    ref = "mstar_core.backends.reference.paged"
    get_registry().register(BackendSpec(
        name="nowin", provides={"paged_prefill": f"{ref}:ReferencePrefillWrapper",
                                "paged_decode": f"{ref}:ReferenceDecodeWrapper",
                                "mixed": f"{ref}:ReferenceMixedWrapper"},
        devices=("cpu",), dtypes=(torch.float32,), priority=10))


@pytest.mark.parametrize("windows,pick", [((-1,), "nowin"), ((-1, 4096), "reference"), ((4096,), "nowin")])
def test_warmup_selects_for_the_windows_as_mstar_backends_does(capsys, windows, pick):
    from mstar_core.cli.backends import collect
    from mstar_core.features import AttentionFeatures

    _register_no_windows_backend()
    rep = warmup(WarmupConfig(torch.float32, 16, 4, 4, 2, windows), "auto", "cpu", ("paged_decode",))
    assert rep.notes[0].startswith(f"{pick} (paged_decode):")
    listed = collect(get_registry(), torch.device("cpu"), torch.float32, 16, AttentionFeatures(layer_windows=windows))
    assert listed["auto"]["paged_decode"]["pick"] == pick
    # and on the command line: warmup --window ... against backends --layer-windows ...
    argv = [f"--window={w}" for w in windows]
    assert main(["warmup", "--device", "cpu", "--dtype", "float32", "--head-dim", "16", "--page-size", "4",
                 "--qo-heads", "4", "--kv-heads", "2", "--capability", "paged_decode", *argv]) == 0
    assert f"  {pick} (paged_decode): nothing to prepare" in capsys.readouterr().out


def test_warmup_selects_for_the_soft_cap():
    _register_no_windows_backend()
    rep = warmup(WarmupConfig(torch.float32, 16, 4, 4, 2, soft_cap=30.0), "auto", "cpu", ("paged_decode",))
    assert rep.notes[0].startswith("reference (paged_decode):")
    assert WarmupConfig(soft_cap=30.0, windows=(-1, 8)).features.requested() == ("soft_cap", "layer_windows")


def _register_fastdec() -> list:
    """A decode-only backend whose warm-up records the capabilities it was asked for (returned)."""
    calls: list = []

    def fake_warmup(cfg, device, caps):
        calls.append(caps)
        return [WarmedKernel("fastdec", c, "full", 0.25, "compiled 1 module") for c in caps]

    get_registry().register(BackendSpec(
        name="fastdec", provides={"paged_decode": "mstar_core.backends.reference.paged:ReferenceDecodeWrapper"},
        devices=("cpu",), dtypes=(torch.float32,), warmup=fake_warmup, api_version="1.1"))
    return calls


def test_auto_over_a_split_pick_warms_each_backend_for_the_capabilities_it_serves():
    calls = _register_fastdec()
    cfg = WarmupConfig(torch.float32, 16, 4, 4, 2)
    rep = warmup(cfg, "auto", "cpu")
    assert calls == [("paged_decode",)]  # auto's decode pick, for decode alone
    assert [(k.backend, k.capability) for k in rep.kernels] == [("fastdec", "paged_decode")]
    assert rep.notes[0] == ("reference (paged_prefill, mixed): nothing to prepare; it compiles nothing on first use")
    # limited to capabilities the reference serves: the decode pick is not warmed
    calls.clear()
    rep = warmup(cfg, "auto", "cpu", capabilities=("paged_prefill", "mixed"))
    assert calls == [] and rep.kernels == ()


def test_a_capability_table_warms_each_capability_s_named_backend():
    calls = _register_fastdec()
    cfg = WarmupConfig(torch.float32, 16, 4, 4, 2)
    rep = warmup(cfg, {"default": "reference"}, "cpu")  # every capability from the reference
    assert calls == [] and rep.kernels == ()
    assert rep.notes[0] == ("reference (paged_prefill, paged_decode, mixed): nothing to prepare; it compiles "
                            "nothing on first use")
    rep = warmup(cfg, {"paged_decode": "fastdec", "default": "reference"}, "cpu")
    assert calls == [("paged_decode",)] and [k.capability for k in rep.kernels] == ["paged_decode"]
