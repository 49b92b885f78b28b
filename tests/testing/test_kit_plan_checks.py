"""What the kit (``mstar check``) plans before anything runs: the window cases of a layer group,
the wrapper sets per device, the replay and device checks on CUDA (a GPU faked: nothing runs),
the device it picks, what it names as not covered, and the pytest entry's plan."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from mstar_core import BackendSpec, BackendUnavailable, CapabilitySpec, HeadDims, Registry
from mstar_core.testing import check as K
from mstar_core.testing import conformance as C
from mstar_core.testing.rules import RuleError

PREFILL = "mstar_core.backends.reference:ReferencePrefillWrapper"
DECODE = "mstar_core.backends.reference:ReferenceDecodeWrapper"
F32 = torch.float32
MIB = 1024 * 1024


def _spec(**kw) -> BackendSpec:
    args = {"name": "k", "provides": {"paged_prefill": PREFILL, "paged_decode": DECODE}, "devices": ("cuda", "cpu"),
            "dtypes": (F32,), "head_dims": HeadDims(values=(64, 128)), "api_version": "1.1", **kw}
    return BackendSpec(**args)


def _registry(spec: BackendSpec) -> Registry:
    reg = Registry(discover=False)
    reg.register(spec, distribution="k-mstar", version="0.1")
    return reg


CLASSES = {"paged_prefill": object, "paged_decode": object}


@pytest.fixture
def gpus(fake_gpu, monkeypatch):
    """``set(count, current)``: that many faked sm90 GPUs, ``current`` the current one."""

    def set_gpus(count: int, current: int = 0) -> None:
        fake_gpu("sm90")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)

    return set_gpus


# -- the window cases of a layer group ----------------------------------------------------------

def test_a_window_adds_the_first_plain_case_and_every_feature_case_at_it():
    cases = K._cases("decode", ("sliding_window",), (64,), quick=True, window=0)
    plain = [c for g, c in cases if g == "plain"]
    features = [c for g, c in cases if g == "features"]
    window = [c for g, c in cases if g == "window"]
    # window 0 is a window (only the current token), not "none": -1 is
    assert window == [dataclasses.replace(c, window_left=0) for c in (plain[0], *features)]
    assert not [g for g, _ in K._cases("decode", (), (64,), quick=True, window=-1) if g == "window"]


def test_ragged_steps_get_no_window_cases():
    assert "window" not in {g for g, _ in K._cases("ragged", (), (64,), quick=True, window=5)}


# -- the CUDA device that is not the current one ----------------------------------------------

@pytest.mark.parametrize(("count", "current", "expected"), [(2, 0, 1), (2, 1, 0), (3, 1, 0), (1, 0, None)])
def test_the_device_case_runs_on_a_gpu_that_is_not_the_current_one(gpus, count, current, expected):
    gpus(count, current)
    other = K._other_cuda(torch.device("cuda"))
    assert other == (None if expected is None else torch.device("cuda", expected))


def test_there_is_no_other_gpu_for_a_cpu_run_or_without_cuda(gpus, monkeypatch):
    gpus(3)
    assert K._other_cuda(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert K._other_cuda(torch.device("cuda")) is None


def test_device_notes_say_what_the_device_checks_could_not_do(gpus):
    assert "--device cuda" in K.device_notes(torch.device("cpu"))[0]
    gpus(1)
    assert K.device_notes(torch.device("cuda")) == [
        "one GPU: the device case (the data on a GPU that is not the current device) needs two"]
    gpus(2)
    assert K.device_notes(torch.device("cuda")) == []


# -- the plan ---------------------------------------------------------------------------------

def test_the_wrapper_set_gets_a_larger_workspace_and_device_indices_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device, workspace, indices in (("cuda", 128 * MIB, True), ("cpu", MIB, False)):
        sets = [c.run.args[0] for c in K.plan_checks(_spec(), CLASSES, device, head_dims=[64], quick=True)]
        assert {(ws.device, ws.workspace_bytes, ws.device_indices) for ws in sets} == {(device, workspace, indices)}


def test_a_capability_without_a_given_head_dim_plans_nothing():
    spec = _spec(per_capability={"paged_decode": CapabilitySpec(head_dims=HeadDims(values=(64,)))})
    checks = K.plan_checks(spec, CLASSES, "cpu", head_dims=[128], quick=True)
    assert checks and {c.capability for c in checks} == {"paged_prefill"}


def _replays(spec: BackendSpec) -> set[tuple[str, str, bool]]:
    checks = K.plan_checks(spec, CLASSES, "cuda", head_dims=[64], quick=True)
    return {(c.capability, c.name, c.run.args[3]) for c in checks if c.group == "replay"}


def test_replay_is_planned_on_cuda_for_the_capturable_capabilities_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _replays(_spec(capturable=("paged_decode",))) == {("paged_decode", "decode-d64", False)}
    assert _replays(_spec(capturable=("paged_prefill",))) == {("paged_prefill", "prefill-d64", False)}
    assert not [c for c in K.plan_checks(_spec(capturable=("paged_decode",)), CLASSES, "cpu", head_dims=[64],
                                         quick=True) if c.group == "replay"]


def test_multi_token_rows_are_replayed_on_the_prefill_wrapper_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    both = ("paged_prefill", "paged_decode")
    multi = {c: ("multi_token_decode",) for c in both}
    assert _replays(_spec(capturable=both, features=multi)) == {
        ("paged_prefill", "prefill-d64-multi_token", True), ("paged_decode", "decode-d64", False)}
    # declared on the decode wrapper alone: the prefill wrapper's replay has no multi-token rows
    decode_only = {"paged_decode": ("multi_token_decode",)}
    assert _replays(_spec(capturable=both, features=decode_only)) == {
        ("paged_prefill", "prefill-d64", False), ("paged_decode", "decode-d64", False)}


def test_the_device_checks_run_the_first_shape_and_plain_case_at_the_largest_head_dim(gpus):
    gpus(2)
    checks = [c for c in K.plan_checks(_spec(), CLASSES, "cuda") if c.group == "device"]
    for cap, kind, plain in (("paged_prefill", "prefill", C.prefill_cases()), ("paged_decode", "decode",
                                                                               C.decode_cases())):
        first = (C.shape_cases(kind, 128)[0], dataclasses.replace(plain[0], head_dim=128))
        assert [c.name for c in checks if c.capability == cap] == [f"cuda:1-{case}" for case in first]
    assert {(c.run.args[0].device, c.run.args[0].device_indices) for c in checks} == {("cuda:1", True)}


# -- one check run ----------------------------------------------------------------------------

def test_a_result_times_its_own_check(monkeypatch):
    monkeypatch.setattr(K, "time", types.SimpleNamespace(perf_counter=iter([100.0, 102.5]).__next__))
    result = K.run_check(K.Check("paged_decode", "plain", F32, "case", lambda: 0.25))
    assert (result.passed, result.error, result.seconds, result.rule) == (True, 0.25, 2.5, None)


def test_a_check_that_raises_is_a_failed_result_naming_its_rule():
    def broken() -> float:
        raise RuleError("oracle", "k decode case", "off by a lot", 0.5)

    result = K.run_check(K.Check("paged_decode", "plain", F32, "case", broken))
    assert (result.passed, result.error, result.rule) == (False, 0.5, "oracle")
    assert result.message.startswith("k decode case: off by a lot")


# -- the device a check picks -----------------------------------------------------------------

def test_a_check_runs_on_cuda_where_the_backend_runs_there(gpus):
    gpus(1)
    reg = _registry(_spec())
    assert K.select_for_check("k", registry=reg)[1] == torch.device("cuda")
    assert K.select_for_check("k", "cpu", registry=reg)[1] == torch.device("cpu")


def test_a_check_runs_on_the_cpu_where_the_backend_does_not_run_on_cuda(gpus):
    gpus(1)
    assert K.select_for_check("k", registry=_registry(_spec(devices=("cpu",))))[1] == torch.device("cpu")
    with pytest.raises(BackendUnavailable, match="unknown"):  # an unknown name is refused as such
        K.select_for_check("nope", registry=_registry(_spec()))


def test_without_cuda_the_backend_is_never_probed_for_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probed: list[str] = []

    def probe(device: torch.device) -> tuple[str, ...]:
        probed.append(device.type)
        return ()

    assert K.select_for_check("k", registry=_registry(_spec(probe=probe)))[1] == torch.device("cpu")
    assert "cuda" not in probed


# -- what is not covered ----------------------------------------------------------------------

def test_nothing_is_named_not_covered_for_a_backend_declaring_no_multi_token_rows():
    assert K.not_covered(_spec(capturable=("paged_decode",)), CLASSES) == {}


def test_multi_token_replay_on_a_capturable_decode_wrapper_is_named_not_covered():
    spec = _spec(capturable=("paged_decode",), features={"paged_decode": ("multi_token_decode",)})
    assert K.not_covered(spec, CLASSES) == {"multi_token_decode replay": (
        "multi-token rows on the decode wrapper are checked eagerly; their graph replay is not checked yet")}
    # the rows on the prefill wrapper are replayed (see the replay plan above)
    prefill = _spec(capturable=("paged_prefill",), features={"paged_prefill": ("multi_token_decode",)})
    assert K.not_covered(prefill, CLASSES) == {}


# -- the pytest entry -------------------------------------------------------------------------

@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("mstar_core.registry.registry._default", _registry(_spec(devices=("cpu",))))


def test_the_pytest_entry_plans_the_full_suite_unless_asked_for_quick(installed):
    def ids(test) -> list[str]:
        (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
        return mark.kwargs["ids"]

    full = [c.id for c in K.plan_checks(_spec(), CLASSES, "cpu", head_dims=[64])]
    quick = [c.id for c in K.plan_checks(_spec(), CLASSES, "cpu", head_dims=[64], quick=True)]
    assert len(quick) < len(full)
    assert ids(K.conformance_test("k", head_dims=[64])) == full
    assert ids(K.conformance_test("k", head_dims=[64], quick=True)) == quick


def test_the_pytest_entry_refuses_a_dtype_the_backend_does_not_declare(installed):
    with pytest.raises(ValueError, match="cannot check dtype float16; it declares float32"):
        K.conformance_test("k", dtypes=[torch.float16])


def test_the_placeholder_for_an_unavailable_backend_never_passes(installed):
    test = K.conformance_test("nope", skip_unavailable=True)
    with pytest.raises(AssertionError):  # skipped by its mark; called anyway, it fails
        test()
