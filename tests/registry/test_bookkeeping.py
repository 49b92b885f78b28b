"""The registry's bookkeeping: what a registration keeps, what a plugin's hook may hand over,
what is loaded once and forgotten with the probe cache, and which plugin a wrapper that does
not import is laid to."""

from __future__ import annotations

import logging

import pytest

from mstar_core import BackendSpec, PluginError, Registry, hookimpl
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.errors import InputError
from mstar_core.registry.measured import MeasuredTable

DECODE = REFERENCE.provides["paged_decode"]


def spec(name: str, **kw) -> BackendSpec:
    return BackendSpec(name=name, provides={"paged_decode": DECODE}, devices=("cpu",), **kw)


@pytest.fixture
def plugin(fake_module, make_ep):
    """``plugin(ep_name, dist, *specs)``: an entry point of ``dist`` whose hook registers ``specs``."""

    def make(ep_name: str, dist: str, *specs) -> object:
        @hookimpl
        def hook(register):
            for s in specs:
                register(s)

        fake_module(f"fake_plugin_{ep_name}", mstar_register_backends=hook)
        return make_ep(ep_name, f"fake_plugin_{ep_name}", dist, "1.0")

    return make


def test_a_spec_keeps_the_distribution_and_version_it_names():
    reg = Registry(discover=False)
    reg.register(spec("own", distribution="own-dist", version="3.1"), distribution="other", version="9")
    reg.register(spec("plain"), distribution="d", version="1")
    assert (reg.get("own").label, reg.get("plain").label) == ("own-dist 3.1", "d 1")


def test_a_name_registered_by_hand_twice_is_refused_naming_the_first():
    reg = Registry(discover=False)
    reg.register(spec("x"), distribution="d", version="1")
    with pytest.raises(PluginError, match="backend 'x' is already registered by d 1"):
        reg.register(spec("x"))


def test_an_allowlist_argument_overrides_the_environment(plugin, fake_entry_points, monkeypatch):
    fake_entry_points(plugin("a", "mstar-a", spec("a")), plugin("b", "mstar-b", spec("b")))
    monkeypatch.setenv("MSTAR_PLUGINS", "a")
    assert Registry(allowlist=None).names() == ["a", "b", "reference"]
    assert Registry(allowlist=["b"]).names() == ["b", "reference"]


def test_only_allowlist_names_no_plugin_has_are_warned_about(plugin, fake_entry_points, caplog):
    fake_entry_points(plugin("a", "mstar-a", spec("a")), plugin("b", "mstar-b", spec("b")))
    with caplog.at_level(logging.WARNING, logger="mstar.registry"):
        Registry(allowlist=["a", "mstar-b", "nowhere"])
    assert [r.getMessage().split("'")[1] for r in caplog.records] == ["nowhere"]


def test_a_hook_with_another_argument_name_fails_its_plugin_at_load(fake_module, make_ep, fake_entry_points):
    @hookimpl
    def mstar_register_backends(reg):
        reg(spec("never"))

    fake_module("fake_wrong_arg", mstar_register_backends=mstar_register_backends)
    fake_entry_points(make_ep("wrong", "fake_wrong_arg", "mstar-wrong"))
    reg = Registry()
    (failure,) = reg.failures
    assert failure.stage == "load" and "Argument(s) {'reg'} are declared in the hookimpl" in failure.error
    assert reg.get("never") is None


def test_registering_something_not_a_spec_names_its_type(plugin, fake_entry_points):
    fake_entry_points(plugin("odd", "mstar-odd", spec("kept_not"), {"name": "x"}))
    reg = Registry()
    (failure,) = reg.failures
    assert "register() takes a BackendSpec, got dict" in failure.error
    assert reg.get("kept_not") is None and failure.backends == ("kept_not",)


def test_a_plugin_registering_one_name_twice_is_refused_whole(plugin, fake_entry_points):
    fake_entry_points(plugin("twice", "mstar-twice", spec("twice"), spec("twice"), spec("other")))
    reg = Registry()
    (failure,) = reg.failures
    assert "it registers backend 'twice' more than once" in failure.error
    assert reg.names() == ["reference"]


def test_a_pin_to_a_distribution_without_the_name_fails_discovery(plugin, fake_entry_points):
    fake_entry_points(plugin("a", "mstar-a", spec("a")))
    with pytest.raises(InputError, match="backend 'a' is pinned to distribution 'mstar-other'.*mstar-a 1.0"):
        Registry(pins={"a": "mstar-other"})


def test_wrappers_are_imported_again_once_the_probe_cache_is_cleared(fake_module):
    reg = Registry(discover=False)
    reg.register(BackendSpec(name="late", provides={"paged_decode": "fake_late_wrappers:Decode"}, devices=("cpu",)))
    assert "its paged_decode wrapper fake_late_wrappers:Decode cannot be loaded" in reg.reasons("late")[0]
    reg.clear_probe_cache()
    assert reg.reasons("late") and len(reg.failures) == 1  # the same failure is listed once
    fake_module("fake_late_wrappers", Decode=object)
    assert reg.reasons("late")  # still the cached answer
    reg.clear_probe_cache()
    assert reg.reasons("late") == []


def test_a_wrapper_that_does_not_import_is_laid_to_the_plugin_that_registered_it(plugin, fake_entry_points):
    broken = BackendSpec(name="mine", provides={"paged_decode": "fake_missing_wrappers:Decode"}, devices=("cpu",))
    fake_entry_points(plugin("rival", "mstar-rival", spec("mine")),  # the same name, another distribution
                      plugin("other", "mstar-mine", spec("other")),  # the same distribution, another name
                      plugin("myplug", "mstar-mine", broken))
    reg = Registry(pins={"mine": "mstar-mine"})
    assert reg.reasons("mine")
    failure = reg.failure_for("mine")
    assert (failure.entry_point, failure.distribution, failure.version, failure.stage) == (
        "myplug", "mstar-mine", "1.0", "provides")


def test_a_spec_the_registry_does_not_hold_fails_as_an_unknown_distribution():
    reg = Registry(discover=False)
    loose = BackendSpec(name="loose", provides={"paged_decode": "fake_missing_wrappers:Decode"}, devices=("cpu",))
    assert reg.reasons(loose)
    (failure,) = reg.failures
    assert (failure.entry_point, failure.distribution, failure.version) == ("loose", "?", "?")


def test_only_the_wrappers_of_the_requested_capabilities_are_judged():
    reg = Registry(discover=False)
    reg.register(BackendSpec(name="half", devices=("cpu",), provides={
        "paged_decode": DECODE, "paged_prefill": "fake_missing_wrappers:Prefill"}))
    assert reg.reasons("half", ["paged_decode"]) == []
    assert "its paged_prefill wrapper" in " ".join(reg.reasons("half", ["paged_prefill"]))
    assert "its paged_prefill wrapper" in " ".join(reg.reasons("half"))  # none requested: every one


def test_a_measured_table_is_loaded_once_and_must_be_a_table(fake_module, caplog):
    loads = []
    good = MeasuredTable.from_dict({"backend": "m", "arch": "sm90", "median_ms": {}}, "m")
    fake_module("fake_tables", good=lambda: loads.append(1) or good, bad=lambda: {"arch": "sm90"})
    reg = Registry(discover=False)
    reg.register(spec("m", measured="fake_tables:good", api_version="1.1"))
    reg.register(spec("n", measured="fake_tables:bad", api_version="1.1"))
    assert reg.measured("m") is good and reg.measured("m") is good and loads == [1]
    with caplog.at_level(logging.WARNING, logger="mstar.registry"):
        assert reg.measured("n") is None
    assert "returned dict, not a MeasuredTable" in caplog.text


def test_min_compute_capability_is_not_judged_on_a_gpu_without_one(fake_gpu):
    fake_gpu("gfx942")
    reg = Registry(discover=False)
    reg.register(BackendSpec(name="amd", provides={"paged_decode": DECODE}, devices=("rocm",),
                             min_compute_capability=(9, 0)))
    assert reg.reasons("amd", device="cuda") == []
