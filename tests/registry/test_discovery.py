"""Plugin discovery: one broken plugin never hides the others; every failure is recorded with
its distribution, version and error; strict mode re-raises; MSTAR_PLUGINS filters."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from importlib import metadata as md
from types import SimpleNamespace

import pytest

from mstar_core import BackendSpec, PluginError, Registry, hookimpl
from mstar_core.registry.discovery import GROUP, distribution_of, entry_points, env_flag, intended_backends


def spec(name: str) -> BackendSpec:
    return BackendSpec(name=name, provides={"paged_decode": "mstar_core.backends.reference:ReferenceDecodeWrapper"})


@pytest.fixture
def plugins(fake_module, make_ep):
    """A good plugin, one that fails to import, one whose hook raises, one that reuses the
    name "good", and one with no hook at all."""

    @hookimpl
    def good_hook(register):
        register(spec("good"))

    @hookimpl
    def raising_hook(register):
        register(spec("half"))  # registered, then the hook fails: nothing of it may be kept
        raise RuntimeError("kernel table corrupt")

    @hookimpl
    def dup_hook(register):
        register(spec("good"))
        register(spec("dup_extra"))

    fake_module("fake_good", mstar_register_backends=good_hook)
    fake_module("fake_raises", mstar_register_backends=raising_hook)
    fake_module("fake_dup", mstar_register_backends=dup_hook)
    fake_module("fake_nohook", something_else=1)
    return [
        make_ep("good", "fake_good", "mstar-good", "1.0"),
        make_ep("broken", "fake_missing_module_xyz", "mstar-broken", "2.1"),
        make_ep("raises", "fake_raises", "mstar-raises", "0.3"),
        make_ep("dup", "fake_dup", "mstar-dup", "4.0"),
        make_ep("nohook", "fake_nohook", "mstar-nohook", "0.0.1"),
    ]


def test_discovery_survives_each_failure_and_records_it(plugins, fake_entry_points):
    fake_entry_points(*plugins)
    reg = Registry()
    # "good" is claimed by two distributions: neither serves it until a pin picks one
    assert reg.names() == ["dup_extra", "reference"]
    assert [c.label for c in reg.conflicts["good"]] == ["mstar-good 1.0", "mstar-dup 4.0"]
    assert reg.get("reference").distribution == "mstar-core"
    by_ep = {f.entry_point: f for f in reg.failures}
    assert set(by_ep) == {"broken", "raises", "nohook"}
    broken = by_ep["broken"]
    assert (broken.distribution, broken.version, broken.stage) == ("mstar-broken", "2.1", "load")
    assert "ModuleNotFoundError" in broken.error and "fake_missing_module_xyz" in broken.error
    raises = by_ep["raises"]
    assert (raises.distribution, raises.version, raises.stage) == ("mstar-raises", "0.3", "register")
    assert "RuntimeError: kernel table corrupt" in raises.error
    assert reg.get("half") is None
    assert raises.backends == ("half",)  # what it meant to register: selecting "half" names this failure
    assert reg.failure_for("half") is raises
    assert by_ep["nohook"].stage == "register" and "no @hookimpl" in by_ep["nohook"].error
    assert "mstar-broken 2.1" in str(broken)


@pytest.mark.parametrize("first_bad", ["broken", "raises", "dup", "nohook"])
def test_strict_mode_fails_one_way_naming_the_plugin(plugins, fake_entry_points, monkeypatch, first_bad):
    good = plugins[0]
    bad = next(ep for ep in plugins if ep.name == first_bad)
    fake_entry_points(good, bad)
    monkeypatch.setenv("MSTAR_STRICT_PLUGINS", "1")
    cause = {"broken": ModuleNotFoundError, "raises": RuntimeError, "dup": None, "nohook": None}[first_bad]
    with pytest.raises(PluginError, match="strict mode") as e:
        Registry().names()  # a name conflict is refused where a lookup meets it (a config's pin may settle it)
    named = "'good' is registered by 2 distributions (mstar-good 1.0 and mstar-dup 4.0)" if first_bad == "dup" else (
        f"plugin {first_bad!r} (mstar-")
    assert named in str(e.value)
    assert (type(e.value.__cause__) if cause else e.value.__cause__) == cause
    # the same plugins without strict mode load (the conflicting name is then served by neither)
    assert Registry(strict=False).get("good") is None if first_bad == "dup" else Registry(strict=False).get("good")


def test_allowlist_loads_only_named_plugins(plugins, fake_entry_points, monkeypatch):
    fake_entry_points(*plugins)
    # by entry-point name ("good") and by distribution name ("mstar-dup")
    monkeypatch.setenv("MSTAR_PLUGINS", "good, mstar-dup")
    reg = Registry()
    assert reg.names() == ["dup_extra", "reference"] and list(reg.conflicts) == ["good"]
    assert reg.failures == []  # broken/raises were never loaded


def test_allowlist_warns_once_for_each_unknown_name(plugins, fake_entry_points, monkeypatch, caplog, recwarn):
    fake_entry_points(*plugins)
    monkeypatch.setenv("MSTAR_PLUGINS", "good,not_installed_anywhere,nor_this")
    with caplog.at_level(logging.WARNING, logger="mstar.registry"):
        reg = Registry()
    assert reg.names() == ["good", "reference"]
    for name in ("not_installed_anywhere", "nor_this"):
        said = [r for r in caplog.records if repr(name) in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert "MSTAR_PLUGINS names" in said[0].getMessage()
    assert [str(w.message) for w in recwarn] == []  # the log line alone, not a warning besides


def test_an_unknown_allowlist_name_is_one_line_on_the_command_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSTAR_")}
    env["MSTAR_PLUGINS"] = "not_installed_anywhere"
    r = subprocess.run([sys.executable, "-m", "mstar_core.cli", "backends", "--device", "cpu", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("not_installed_anywhere") == 1, r.stderr


def test_empty_allowlist_loads_no_plugin(plugins, fake_entry_points, monkeypatch):
    fake_entry_points(*plugins)
    monkeypatch.setenv("MSTAR_PLUGINS", "")
    reg = Registry()
    # only the core's own reference: an allowlist never leaves the engine without a backend
    assert reg.names() == ["reference"]
    assert reg.failures == [] and [p.entry_point for p in reg.plugins] == ["reference"]


def test_reference_registers_through_the_hook_when_metadata_lacks_it(fake_entry_points):
    fake_entry_points()
    reg = Registry()
    assert reg.names() == ["reference"]
    assert reg.plugins[0].module == "mstar_core.backends.reference.plugin"


def test_plugin_modules_import_no_kernel_library(fake_entry_points, make_ep, monkeypatch):
    """The real plugin modules register without importing flashinfer / flash_attn_interface /
    aiter; blocking those imports would break any plugin that tried."""
    for mod in ("flashinfer", "flash_attn_interface", "aiter"):
        monkeypatch.setitem(sys.modules, mod, None)  # `import mod` now raises ImportError
    for mod in ("mstar_flashinfer.plugin", "mstar_fa3.plugin", "mstar_rocm.plugin"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    fake_entry_points(
        make_ep("flashinfer", "mstar_flashinfer.plugin", "mstar-flashinfer", "0.1.0"),
        make_ep("fa3", "mstar_fa3.plugin", "mstar-fa3", "0.1.0"),
        make_ep("rocm", "mstar_rocm.plugin", "mstar-rocm", "0.1.0"),
    )
    reg = Registry(strict=True)
    assert reg.names() == ["fa3", "flashinfer", "reference", "rocm"]
    assert reg.get("fa3").provides == {
        "paged_prefill": "mstar_fa3.paged:FA3PrefillWrapper", "paged_decode": "mstar_fa3.paged:FA3DecodeWrapper",
        "mixed": "mstar_fa3.paged:FA3MixedWrapper", "prefixed_ragged": "mstar_fa3.ragged:FA3PrefixedPrefillWrapper"}


def test_probe_is_cached_per_device(fake_gpu):
    calls = []

    def probe(device):
        calls.append(str(device))
        return []

    reg = Registry(discover=False)
    reg.register(BackendSpec(name="p", provides={"mixed": "m:a"}, probe=probe))
    fake_gpu("sm90")
    for dev in ("cpu", "cpu", "cuda", "cuda:0"):
        reg.reasons("p", device=dev)
    assert calls == ["cpu", "cuda"]  # "cuda" and "cuda:0" are one device


def test_a_crashing_probe_is_a_reason_not_an_exception():
    def probe(device):
        raise OSError("libcuda.so not found")

    reg = Registry(discover=False)
    reg.register(BackendSpec(name="p", provides={"mixed": "m:a"}, probe=probe))
    assert reg.reasons("p") == ["probe failed (OSError: libcuda.so not found)"]


def test_spec_validation_names_what_is_wrong():
    with pytest.raises(ValueError, match="unknown capabilities \\['paged_everything'\\]"):
        BackendSpec(name="x", provides={"paged_everything": "m:a"})
    with pytest.raises(ValueError, match="'module:attr'"):
        BackendSpec(name="x", provides={"mixed": "no_colon"})
    with pytest.raises(ValueError, match="unknown devices"):
        BackendSpec(name="x", provides={"mixed": "m:a"}, devices=("tpu",))


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
        register(spec("twice"))

    fake_module("fake_twice", mstar_register_backends=hook)
    ep = make_ep("twice", "fake_twice", "mstar-twice", "1.0")
    fake_entry_points(ep, make_ep("twice", "fake_twice", "mstar-twice", "1.0"))
    assert [(e.name, e.value) for e in entry_points()].count(("twice", "fake_twice")) == 1
    reg = Registry()
    assert calls == [1]
    assert "twice" in reg.names() and reg.failures == []


def test_intended_backends_reads_one_string_name_per_call(tmp_path, monkeypatch):
    (tmp_path / "fake_intended_src.py").write_text(textwrap.dedent("""
        import kernels
        A = BackendSpec(name="by_keyword", provides={})
        B = kernels.BackendSpec("positional", {})
        C = BackendSpec("first_argument", name="keyword_wins")
        D = BackendSpec(name=NAME)  # not a literal: unknown without running it
        E = BackendSpec(name=3)
        F = BackendSpec(name="by_keyword")
        G = OtherSpec(name="not_a_backend")
    """), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert intended_backends("fake_intended_src") == ("by_keyword", "positional", "keyword_wins")


@pytest.mark.parametrize("dist,expected", [
    (SimpleNamespace(name="by-name", version="1.2"), ("by-name", "1.2")),
    (SimpleNamespace(metadata={"Name": "by-metadata"}, version="2.0"), ("by-metadata", "2.0")),
    (SimpleNamespace(), ("?", "?")),
])
def test_distribution_of_reads_the_name_then_the_metadata_else_a_question_mark(dist, expected):
    assert distribution_of(md.EntryPoint(name="x", value="x_mod", group=GROUP)._for(dist)) == expected
