"""Second, focused tests for registry behaviours that only one other test pinned down (issue 10):
auto's order among third-party plugins, boolean environment values, entry points listed twice,
and names given with blanks around them."""

from __future__ import annotations

import pytest
import torch

from mstar_core import BackendSpec, Registry, hookimpl, select_backend
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.registry.discovery import entry_points, env_flag

F32 = torch.float32


def cpu_spec(name: str, priority: int = 0) -> BackendSpec:
    """A backend that can serve ``bounded`` on the CPU in float32 (through the reference's wrapper)."""
    return BackendSpec(name=name, provides={"bounded": REFERENCE.provides["bounded"]}, devices=("cpu",),
                       dtypes=(F32,), priority=priority)


def test_auto_picks_the_third_party_backend_of_highest_priority():
    """Among third-party plugins that can all serve the request, auto takes the one with the
    highest declared priority — whatever the registration or alphabetical order — and records
    none of the lower ones as rejected (they were never tried)."""
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    reg.register(cpu_spec("alpha", priority=1))
    reg.register(cpu_spec("omega", priority=9))
    reg.register(cpu_spec("mid", priority=4))
    sel = select_backend(("bounded",), requested="auto", device="cpu", dtype=F32, head_dim=64, registry=reg)
    assert sel.name == "omega" and sel.rejected == {}
    reg2 = Registry(discover=False)
    reg2.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    reg2.register(cpu_spec("low", priority=-3))
    reg2.register(cpu_spec("high", priority=2))
    sel = select_backend(("bounded",), requested="auto", device="cpu", dtype=F32, head_dim=64, registry=reg2)
    assert sel.name == "high"


@pytest.mark.parametrize("raw,expected", [("\tyes\n", True), ("  1", True), ("TRUE  ", True), ("\toff ", False),
                                          (" 0\n", False)])
def test_env_flag_ignores_blanks_around_the_value(monkeypatch, raw, expected):
    """A boolean environment variable is read with surrounding blanks (spaces, tabs, a newline
    from ``$(cat file)``) ignored, in any case."""
    monkeypatch.setenv("MSTAR_TEST_FLAG", raw)
    assert env_flag("MSTAR_TEST_FLAG") is expected


def test_an_entry_point_listed_twice_loads_once(fake_module, make_ep, fake_entry_points):
    """A distribution installed twice (editable and a --target copy) lists its entry point twice:
    discovery keeps the first of each (name, value) pair, so the plugin registers once and no
    "duplicate" failure is recorded."""
    calls = []

    @hookimpl
    def hook(register):
        calls.append(1)
        register(cpu_spec("twice"))

    fake_module("fake_twice", mstar_register_backends=hook)
    ep = make_ep("twice", "fake_twice", "mstar-twice", "1.0")
    fake_entry_points(ep, make_ep("twice", "fake_twice", "mstar-twice", "1.0"))
    assert [(e.name, e.value) for e in entry_points()].count(("twice", "fake_twice")) == 1
    reg = Registry()
    assert calls == [1]
    assert "twice" in reg.names() and reg.failures == []


def test_a_requested_name_with_blanks_around_it_selects_that_backend():
    """A backend name given with blanks around it (``" reference "``, as a config line or an
    argument may hold it) names that backend."""
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    reg.register(cpu_spec("toy"))
    for requested, want in ((" reference ", "reference"), ("toy\n", "toy")):
        sel = select_backend(("bounded",), requested=requested, device="cpu", dtype=F32, head_dim=64, registry=reg)
        assert sel.name == want and sel.requested == want and sel.source == "argument"
