"""The plugin contract's registry side: API versions, a name two distributions
claim, ``provides`` references that do not resolve, failing hooks named by distribution and
entry point, and strict mode failing one way."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from mstar_core import (
    BackendSpec,
    BackendUnavailable,
    PluginError,
    Registry,
    hookimpl,
    select_backend,
)
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.cli import main
from mstar_core.registry import api

DECODE = "mstar_core.backends.reference:ReferenceDecodeWrapper"
CPU, F32 = "cpu", torch.float32
PAGED = ("paged_prefill", "paged_decode", "mixed")


def spec(name: str, **kw) -> BackendSpec:
    kw.setdefault("provides", {"paged_decode": DECODE})
    return BackendSpec(name=name, devices=("cpu",), dtypes=(F32,), **kw)


def plugin(fake_module, module: str, *specs: BackendSpec):
    @hookimpl
    def hook(register):
        for s in specs:
            register(s)

    fake_module(module, mstar_register_backends=hook)


# -- API versions --------------------------------------------------------------------------------

def test_api_rule():
    assert api.API_VERSION == "2.0"
    # every released version still runs on this core: 1.x through the loose-argument adapter
    assert api.incompatibility("1.0") is None and api.incompatibility("1.1") is None
    assert api.incompatibility("2.0") is None
    minor = api.incompatibility("1.2") or ""
    assert "compatible: 1.0 to 1.1, 2.0 to 2.0" in minor and "upgrade mstar-core" in minor
    future = api.incompatibility("3.0") or ""
    assert "upgrade mstar-core to a release implementing it" in future
    assert api.incompatibility("1.0", "1.3") is None  # an older minor keeps working
    newer = api.incompatibility("1.4", "1.3") or ""
    assert "plugin API 1.4" in newer and "plugin API 1.3" in newer and "upgrade mstar-core" in newer
    major = api.incompatibility("2.0", "1.3") or ""
    assert "2.0" in major and "1.3" in major
    old = api.incompatibility("0.9", "1.3") or ""
    assert "upgrade the plugin" in old
    with pytest.raises(ValueError, match="'MAJOR.MINOR'"):
        BackendSpec(name="x", provides={"paged_decode": DECODE}, api_version="1")


def test_a_malformed_api_version_fails_the_whole_hook(fake_module, make_ep, fake_entry_points, monkeypatch, capsys):
    @hookimpl
    def hook(register):
        register(spec("fine"))  # registered first, and dropped with the rest
        register(spec("sloppy", api_version="1"))

    fake_module("sloppy_plugin", mstar_register_backends=hook)
    fake_entry_points(make_ep("sloppy", "sloppy_plugin", "sloppy-kernels", "0.1"))
    reg = Registry()
    assert "fine" not in reg.names() and "sloppy" not in reg.names()
    (f,) = reg.failures
    assert (f.stage, f.backends) == ("register", ("fine",))
    assert str(f) == ("plugin 'sloppy' (sloppy-kernels 0.1, meant to register 'fine') failed at register: InputError: "
                      "backend 'sloppy': api_version must be a 'MAJOR.MINOR' string such as '2.0' (the plugin contract "
                      "version the backend was written for), got '1'; none of its backends is registered")
    with pytest.raises(BackendUnavailable, match=r"'fine' \(from argument\) is unknown: its plugin failed: .*; none "
                                                 r"of its backends is registered"):
        select_backend(("paged_decode",), requested="fine", device=CPU, dtype=F32, registry=reg)
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)
    assert main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "got '1'; none of its backends is registered" in out.split("plugins that failed to load:")[1]
    monkeypatch.setenv("MSTAR_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"strict mode: .*api_version must be .*; none of its backends is registered"):
        Registry()


def test_a_malformed_api_version_at_import_fails_the_plugin_at_load(tmp_path, make_ep, fake_entry_points):
    (tmp_path / "sloppy_at_import.py").write_text(textwrap.dedent("""
        from mstar_core import BackendSpec, hookimpl

        FINE = BackendSpec(name="fine", provides={"paged_decode": "m:c"})
        SLOPPY = BackendSpec(name="sloppy", provides={"paged_decode": "m:c"}, api_version="v1")

        @hookimpl
        def mstar_register_backends(register):
            register(FINE)
            register(SLOPPY)
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        fake_entry_points(make_ep("sloppy", "sloppy_at_import", "sloppy-kernels", "0.1"))
        reg = Registry()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("sloppy_at_import", None)
    (f,) = reg.failures
    assert (f.stage, f.backends) == ("load", ("fine", "sloppy"))  # the names, read from its source
    assert "got 'v1'; none of its backends is registered" in str(f)
    assert reg.names() == ["reference"]


def test_an_incompatible_backend_is_listed_never_probed_imported_or_picked(monkeypatch):
    probed = []
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core")
    reg.register(spec("future", api_version="3.0", probe=lambda d: probed.append(d) or [],
                      provides={"paged_decode": "mstar_never_imported_xyz:W"}), distribution="future-kernels")
    (reason,) = reg.reasons("future", device=CPU)
    assert "written for plugin API 3.0" in reason and f"implements plugin API {api.API_VERSION}" in reason
    assert probed == [] and "mstar_never_imported_xyz" not in sys.modules
    sel = select_backend(("paged_decode",), device=CPU, dtype=F32, registry=reg)
    assert sel.name == "reference" and "plugin API 3.0" in sel.rejected["future"][0]
    with pytest.raises(BackendUnavailable, match="written for plugin API 3.0"):
        select_backend(("paged_decode",), requested="future", device=CPU, dtype=F32, registry=reg)
    assert probed == []


def test_a_compatible_older_plugin_keeps_working(monkeypatch):
    monkeypatch.setattr(api, "API_VERSION", "1.2")
    reg = Registry(discover=False)
    reg.register(spec("old", api_version="1.0"))
    reg.register(spec("newer", api_version="1.3"))
    assert select_backend(("paged_decode",), requested="old", device=CPU, dtype=F32, registry=reg).name == "old"
    with pytest.raises(BackendUnavailable,
                       match=r"written for plugin API 1\.3, but this mstar-core implements plugin API 1\.2"):
        select_backend(("paged_decode",), requested="newer", device=CPU, dtype=F32, registry=reg)


# -- one name, two distributions ----------------------------------------------------------------

@pytest.fixture
def two_fasts(fake_module, make_ep, fake_entry_points):
    """An impostor found first on the path and the real plugin, both registering ``fast``."""
    plugin(fake_module, "impostor_plugin", spec("fast", description="impostor"))
    plugin(fake_module, "real_plugin", spec("fast", description="real"), spec("fast_extra"))
    fake_entry_points(make_ep("fast", "impostor_plugin", "impostor-kernels", "6.6"),
                      make_ep("fast", "real_plugin", "fast-kernels", "1.0"))


def test_a_name_two_distributions_claim_is_served_by_neither(two_fasts):
    reg = Registry()
    assert "fast" not in reg.names() and "fast_extra" in reg.names()
    assert [c.distribution for c in reg.conflicts["fast"]] == ["impostor-kernels", "fast-kernels"]
    with pytest.raises(BackendUnavailable) as e:
        select_backend(("paged_decode",), requested="fast", device=CPU, dtype=F32, registry=reg)
    msg = str(e.value)
    assert "registered by 2 distributions (impostor-kernels 6.6 and fast-kernels 1.0)" in msg
    assert "MSTAR_BACKEND_PINS=fast=DISTRIBUTION" in msg
    auto = select_backend(("paged_decode",), device=CPU, dtype=F32, registry=reg)
    assert auto.name == "fast_extra" and "registered by 2 distributions" in auto.rejected["fast"][0]


def test_a_conflicted_name_is_passed_over_only_where_a_claimant_provides_the_capability(
        two_fasts, fake_module, make_ep, fake_entry_points, monkeypatch, capsys):
    reg = Registry()
    assert "fast" in select_backend(("paged_decode",), device=CPU, dtype=F32, registry=reg).rejected
    for caps in (("prefixed_ragged",), ("bounded",)):  # both claimants provide paged_decode alone
        sel = select_backend(caps, device=CPU, dtype=F32, registry=reg)
        assert sel.name == "reference" and "fast" not in sel.rejected, caps
    # the paged group: decode from the decode-only plugin, the conflict listed for decode alone
    sel = select_backend(PAGED, device=CPU, dtype=F32, registry=reg)
    assert sel.names == {"paged_prefill": "reference", "paged_decode": "fast_extra", "mixed": "reference"}
    assert [c for c, r in sel.rejected_by.items() if "fast" in r] == ["paged_decode"]
    with pytest.raises(BackendUnavailable) as e:  # a refusal lists the providers alone too
        select_backend(("prefixed_ragged",), device=CPU, dtype=torch.int8, registry=reg)
    assert list(e.value.reasons) == ["reference"]
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)
    assert main(["backends", "--json", "--device", "cpu"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert [cap for cap, a in auto.items() if "fast" in a["rejected"]] == ["paged_decode"]
    # claimants that provide different capabilities: listed for each capability one of them provides
    ragged = {"prefixed_ragged": REFERENCE.provides["prefixed_ragged"]}
    plugin(fake_module, "ragged_plugin", spec("fast", provides=ragged))
    plugin(fake_module, "decode_plugin", spec("fast"))
    fake_entry_points(make_ep("fast", "ragged_plugin", "ragged-kernels", "1.0"),
                      make_ep("fast", "decode_plugin", "decode-kernels", "1.0"))
    reg = Registry()
    for caps, listed in ((("prefixed_ragged",), True), (("paged_decode",), True), (("bounded",), False)):
        rejected = select_backend(caps, device=CPU, dtype=F32, registry=reg).rejected
        assert ("fast" in rejected) is listed, caps


def test_a_pin_in_env_or_config_picks_one(two_fasts, monkeypatch):
    cfg = {"attention": {"backend": "fast", "pins": {"fast": "fast-kernels"}}}
    sel = select_backend(("paged_decode",), device=CPU, dtype=F32, registry=Registry(), config=cfg)
    assert (sel.name, sel.backend.distribution, sel.backend.description) == ("fast", "fast-kernels", "real")
    with pytest.raises(ValueError, match="pinned to distribution 'nobody', which does not register it; registered "
                                         "by: impostor-kernels 6.6, fast-kernels 1.0"):
        select_backend(("paged_decode",), device=CPU, dtype=F32, registry=Registry(),
                       config={"attention": {"pins": {"fast": "nobody"}}})
    monkeypatch.setenv("MSTAR_BACKEND_PINS", "fast=impostor-kernels")
    reg = Registry()
    assert reg.get("fast").distribution == "impostor-kernels" and reg.conflicts == {}
    # the environment wins over config, as it does for the backend's name
    sel = select_backend(("paged_decode",), device=CPU, dtype=F32, registry=reg, config=cfg)
    assert sel.backend.distribution == "impostor-kernels"
    monkeypatch.setenv("MSTAR_BACKEND_PINS", "fast")
    with pytest.raises(ValueError, match="is not NAME=DISTRIBUTION"):
        Registry()


def test_a_name_the_config_pins_is_judged_on_its_own_reasons_not_as_a_conflict(two_fasts):
    pinned = {"attention": {"pins": {"fast": "fast-kernels"}}}
    with pytest.raises(BackendUnavailable) as e:
        select_backend(("paged_decode",), device=CPU, dtype=torch.int8, registry=Registry(), config=pinned)
    assert "dtype int8 is not supported" in e.value.reasons["fast"][0]
    assert not any("registered by 2 distributions" in r for r in e.value.reasons["fast"])


def test_backends_lists_both_claimants_with_the_conflict(two_fasts, monkeypatch, capsys):
    monkeypatch.setattr("mstar_core.registry.registry._default", Registry())
    assert main(["backends", "--json", "--device", "cpu"]) == 0
    rows = [b for b in json.loads(capsys.readouterr().out)["backends"] if b["name"] == "fast"]
    assert [(b["distribution"], b["conflict"], b["available"]) for b in rows] == [
        ("fast-kernels", True, False), ("impostor-kernels", True, False)]
    assert "registered by 2 distributions" in rows[0]["reasons"][0]


def test_strict_mode_refuses_an_unpinned_conflict_and_accepts_a_pinned_one(two_fasts, monkeypatch):
    reg = Registry(strict=True)
    with pytest.raises(PluginError, match="strict mode: backend name 'fast' is registered by 2 distributions"):
        reg.names()
    with pytest.raises(PluginError, match="strict mode: backend name 'fast'"):
        select_backend(("paged_decode",), device=CPU, dtype=F32, registry=reg)
    # a config's pin settles it for that selection, an env pin for every one
    cfg = {"attention": {"backend": "fast", "pins": {"fast": "fast-kernels"}}}
    sel = select_backend(("paged_decode",), device=CPU, dtype=F32, registry=reg, config=cfg)
    assert sel.backend.description == "real"
    assert Registry(strict=True, pins={"fast": "fast-kernels"}).get("fast").description == "real"


def test_the_reference_name_is_reserved(fake_module, make_ep, fake_entry_points):
    plugin(fake_module, "squatter", spec("reference"))
    fake_entry_points(make_ep("squat", "squatter", "squatter-dist", "1.0"))
    reg = Registry()
    assert reg.get("reference").distribution == "mstar-core"
    (f,) = reg.failures
    assert f.stage == "register" and "reserved for mstar-core" in f.error


# -- provides that do not resolve ---------------------------------------------------------------

def test_a_missing_provides_class_is_not_available(fake_module, make_ep, fake_entry_points, monkeypatch, capsys):
    plugin(fake_module, "typo_plugin",
           spec("typo", provides={"paged_decode": "mstar_core.backends.reference:NoSuchWrapper"}))
    fake_entry_points(make_ep("typo", "typo_plugin", "typo-kernels", "0.1"))
    reg = Registry()
    (reason,) = reg.reasons("typo", device=CPU)
    assert ("its paged_decode wrapper mstar_core.backends.reference:NoSuchWrapper cannot be loaded (AttributeError"
            in reason)
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)
    assert main(["backends", "--json", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    (typo,) = [b for b in data["backends"] if b["name"] == "typo"]
    assert typo["available"] is False and "NoSuchWrapper" in typo["reasons"][0]
    assert data["auto"]["paged_decode"]["pick"] == "reference" and "typo" in data["auto"]["paged_decode"]["rejected"]
    strict = Registry(strict=True)
    for _ in range(2):  # every time, though the answer is cached
        with pytest.raises(PluginError, match=r"strict mode: plugin 'typo' \(typo-kernels 0.1, meant to register "
                                              r"'typo'\) failed at provides"):
            strict.reasons("typo", device=CPU)
    assert [f.stage for f in reg.failures] == ["provides"]  # listed with the other failures


# -- failing hooks, named ------------------------------------------------------------------------

HOOK_THAT_RAISES = """
    from mstar_core.registry import BackendSpec, hookimpl

    @hookimpl
    def mstar_register_backends(register):
        register(BackendSpec(name="tpk", provides={"paged_decode": "tpkernel_mstar.w:W"}, devices=("gpu",)))
"""


@pytest.fixture
def raising_plugin(tmp_path, monkeypatch, make_ep, fake_entry_points):
    """A real module file (its source is readable) whose hook raises building its spec; the
    entry point's name differs from the backend's."""
    (tmp_path / "tpkernel_plugin.py").write_text(textwrap.dedent(HOOK_THAT_RAISES))
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_entry_points(make_ep("tpkernel", "tpkernel_plugin", "tpkernel-mstar", "0.3"))


def test_a_hook_failure_names_its_distribution_entry_point_and_backend(raising_plugin):
    reg = Registry()
    (f,) = reg.failures
    assert (f.entry_point, f.distribution, f.version, f.stage, f.backends) == (
        "tpkernel", "tpkernel-mstar", "0.3", "register", ("tpk",))
    assert "unknown devices ['gpu']" in f.error
    with pytest.raises(BackendUnavailable,
                       match=r"'tpk' \(from argument\) is unknown: its plugin failed: plugin "
                             r"'tpkernel' \(tpkernel-mstar 0.3, meant to register 'tpk'\) failed at "
                             r"register: InputError"):
        select_backend(("paged_decode",), requested="tpk", device=CPU, dtype=F32, registry=reg)


@pytest.mark.parametrize("kind", ["load", "register", "provides", "conflict"])
def test_strict_mode_fails_one_way_on_the_cli(kind, fake_module, make_ep, fake_entry_points, monkeypatch, capsys):
    if kind == "load":
        fake_entry_points(make_ep("gone", "mstar_gone_module_xyz", "gone-kernels", "1.0"))
    elif kind == "register":
        fake_module("nohook_plugin", x=1)
        fake_entry_points(make_ep("nohook", "nohook_plugin", "nohook-kernels", "1.0"))
    elif kind == "provides":
        plugin(fake_module, "typo_plugin",
               spec("typo", provides={"paged_decode": "mstar_core.backends.reference:Nope"}))
        fake_entry_points(make_ep("typo", "typo_plugin", "typo-kernels", "1.0"))
    else:
        plugin(fake_module, "a_plugin", spec("fast"))
        plugin(fake_module, "b_plugin", spec("fast"))
        fake_entry_points(make_ep("fast", "a_plugin", "a-kernels", "1.0"),
                          make_ep("fast", "b_plugin", "b-kernels", "1.0"))
    monkeypatch.setenv("MSTAR_STRICT_PLUGINS", "1")
    assert main(["backends", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar backends: error: strict mode:") and err.count("\n") == 1
    assert ("a-kernels" in err and "b-kernels" in err) if kind == "conflict" else "-kernels 1.0" in err


def test_the_names_a_failed_plugin_meant_are_read_without_running_its_package(tmp_path, monkeypatch):
    from mstar_core.registry.discovery import intended_backends

    pkg = tmp_path / "sideeffect_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('the package ran')\n")
    (pkg / "plugin.py").write_text("from mstar_core.registry import BackendSpec\nS = BackendSpec(name='quiet', "
                                   "provides={})\nT = BackendSpec('second', {})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert intended_backends("sideeffect_pkg.plugin") == ("quiet", "second")
    assert "sideeffect_pkg" not in sys.modules
    assert intended_backends("no_such_module_anywhere") == ()


def test_a_priority_per_capability_needs_plugin_api_2_0():
    with pytest.raises(ValueError, match=r"a priority per capability came with plugin API 2\.0, but the spec declares "
                                         r"api_version '1\.1'"):
        spec("old", api_version="1.1", priority={"paged_decode": 5})
    assert spec("new", api_version="2.0", priority={"paged_decode": 5}).priority_for("paged_decode") == 5
