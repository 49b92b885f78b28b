"""Strict configuration: unknown tables and keys are errors naming them and the
closest known one; `--config FILE` on demo, bench and generate; a kernel's exception names its
backend and wrapper, and `mstar -v` prints its traceback; `mstar new-backend` writes all or
nothing."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from mstar_core import BackendSpec, Config, Registry
from mstar_core.backends import reference as R
from mstar_core.cli import main
from mstar_core.config import load_config
from mstar_core.errors import InputError
from mstar_core.plugin import API_VERSION
from mstar_core.scaffold import files_for, write_skeleton


@pytest.mark.parametrize("config,message", [
    ({"attenton": {"backend": "x"}}, "unknown table 'attenton' (did you mean 'attention'?)"),
    ({"attention": {"bakend": "x"}}, "unknown key 'bakend' in [attention] (did you mean 'backend'?); known keys: "
                                     "backend, pins"),
    ({"mstar": {"attention": {"backend": "x"}}}, "unknown table 'mstar' (it holds [attention]: nested one table too "
                                                 "deep? [attention] belongs at the top level)"),
    ({"attention": {"attention": {"backend": "x"}}}, "unknown key 'attention' in [attention] ([attention] nested "
                                                     "inside [attention]: it belongs at the top level)"),
    ({"attention": {"pins": {"fast": 3}}}, "attention.pins: 'fast' = 3: a pin maps a backend name"),
    ({"attention": {"pins": ["fast"]}}, "attention.pins must map backend names to distribution names"),
    ({"attention": {"backend": 3}}, "attention.backend must be a string"),
])
def test_config_mistakes_are_named(config, message):
    with pytest.raises(ValueError) as e:
        load_config(config)
    assert message in str(e.value)


def test_a_good_config_and_a_file(tmp_path):
    assert load_config(None) == Config() and load_config({}) == Config()
    cfg = load_config({"attention": {"backend": "fa3", "pins": {"fa3": "my-fa3"}}})
    assert cfg == Config("fa3", {"fa3": "my-fa3"})
    path = tmp_path / "mstar.toml"
    path.write_text('[attention]\nbackend = "reference"\n[attention.pins]\nfast = "fast-kernels"\n')
    assert load_config(path) == Config("reference", {"fast": "fast-kernels"})
    path.write_text('[attention]\nbakend = "reference"\n')
    with pytest.raises(ValueError, match=r"config file '.*mstar.toml': unknown key 'bakend'"):
        load_config(str(path))


@pytest.mark.parametrize("command", [["demo"], ["demo", "--workload", "denoise"], ["bench", "--steps", "1"],
                                     ["generate", "model-dir-never-read", "--prompt", "1"], ["backends"]])
def test_config_option_fails_before_anything_is_built(command, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[attenton]\nbackend = "reference"\n')
    assert main([*command, "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown table 'attenton' (did you mean 'attention'?)" in err and err.count("\n") == 1


def test_config_option_names_the_backend(tmp_path, capsys):
    good = tmp_path / "good.toml"
    good.write_text('[attention]\nbackend = "no_such_backend"\n')
    assert main(["demo", "--config", str(good)]) == 2
    assert "'no_such_backend' (from config) is unknown" in capsys.readouterr().err
    # generate names it before it reads the model (the directory does not exist), transformers or not
    assert main(["generate", "model-dir-never-read", "--ids", "--prompt", "1", "--config", str(good)]) == 2
    err = capsys.readouterr().err
    assert "'no_such_backend' (from config) is unknown" in err and "Known backends: " in err
    good.write_text('[attention]\nbackend = "reference"\n')
    assert main(["bench", "--steps", "1", "--warmup", "1", "--config", str(good)]) == 0
    assert "backend: reference" in capsys.readouterr().out


# -- a kernel's exception ----------------------------------------------------------------------

class BoomMixed(R.ReferenceMixedWrapper):
    def run(self, q, kv_cache_layer, **kw):
        raise RuntimeError("kernel exploded")


@pytest.fixture
def boom(monkeypatch):
    mod = types.ModuleType("mstar_boom")
    mod.BoomMixed = BoomMixed
    monkeypatch.setitem(sys.modules, "mstar_boom", mod)
    reg = Registry(discover=False)
    ref = "mstar_core.backends.reference:Reference"
    reg.register(BackendSpec(name="boom", devices=("cpu",), dtypes=(__import__("torch").float32,), provides={
        "paged_prefill": ref + "PrefillWrapper", "paged_decode": ref + "DecodeWrapper",
        "mixed": "mstar_boom:BoomMixed"}))
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)


def test_a_kernel_exception_is_reported_as_a_bug_naming_its_backend_and_wrapper(boom, capsys):
    # not an MstarError: the CLI prints the whole traceback (with the note naming the backend and
    # wrapper it came from), says it is a bug, and exits 1
    assert main(["demo", "--backend", "boom"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise RuntimeError("kernel exploded")' in err
    assert f"raised in {BoomMixed.__module__}.BoomMixed.run (attention backend 'boom')" in err
    assert "mstar demo: internal error (RuntimeError): this is a bug" in err


def test_an_mstar_error_is_one_line_and_verbose_adds_the_traceback(capsys):
    assert main(["demo", "--backend", "no-such-backend"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar demo: error: attention backend 'no-such-backend'") and "Traceback" not in err
    assert main(["-v", "demo", "--backend", "no-such-backend"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "BackendUnavailable" in err


# -- mstar new-backend ---------------------------------------------------------------------------

def test_new_backend_refuses_bad_names_and_occupied_directories(tmp_path, capsys):
    for bad in ("Tpk", "9k", "my-kernel", ""):
        with pytest.raises(ValueError, match="must start with a lowercase letter"):
            files_for(bad)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    assert main(["new-backend", "tpk", str(occupied)]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    written = write_skeleton("tpk", empty)
    assert {p.relative_to(empty).as_posix() for p in written} == set(files_for("tpk"))


def test_new_backend_writes_nothing_when_it_fails_half_way(tmp_path, monkeypatch):
    calls = []
    real = Path.write_text

    def flaky(self, text, *a, **kw):
        calls.append(self)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(self, text, *a, **kw)

    monkeypatch.setattr(Path, "write_text", flaky)
    with pytest.raises(InputError, match="cannot create '.*new': disk full; nothing was written"):
        write_skeleton("tpk", tmp_path / "new")
    assert list(tmp_path.iterdir()) == []  # neither the target nor the staging folder


def test_the_skeleton_declares_the_current_api_and_its_spec_loads():
    files = files_for("tpk")
    assert f'api_version="{API_VERSION}"' in files["tpk_mstar/plugin.py"] and API_VERSION == "2.0"
    assert 'tpk = "tpk_mstar.plugin"' in files["pyproject.toml"]
    assert 'conformance_test("tpk")' in files["tests/test_conformance.py"]


def test_new_backend_refuses_the_reserved_name_and_writes_readable_files(tmp_path):
    with pytest.raises(ValueError, match="reserved for mstar-core"):
        files_for("reference")
    target = tmp_path / "empty"
    target.mkdir()
    write_skeleton("tpk", target)  # an empty directory is replaced in one step
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~umask
    made = tmp_path / "a" / "b" / "c"
    write_skeleton("tpk", made)
    assert (made / "pyproject.toml").is_file()


def test_a_wrapper_constructor_failure_names_its_backend(boom, monkeypatch, capsys):
    def broken_init(self, *a, **kw):
        raise RuntimeError("no such device")

    monkeypatch.setattr(BoomMixed, "__init__", broken_init)
    assert main(["demo", "--backend", "boom"]) == 1
    assert "BoomMixed.__init__ (attention backend 'boom')" in capsys.readouterr().err


def test_a_config_file_with_a_utf8_bom_is_read(tmp_path, capsys):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[attention]\nbackend = \"referenc\"\n")
    assert load_config(path).backend == "referenc"
    # read, and the backend it names reaches selection (where the misspelling is caught)
    assert main(["bench", "--config", str(path)]) == 2
    assert "'referenc' (from config) is unknown" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [
    ("", None),  # empty: no config
    ("[attention]\nbackend = 3\n", "attention.backend must be a string (a backend name or 'auto') or a table of "
                                   "capability -> backend name, got 3"),
    ("attention = 3\n", "'attention' must be a table"),
    ("[attention]\nbackend = \"reference\"\ncolour = 1\n", "unknown key 'colour' in [attention]"),
    ("[attention\n", "is not valid TOML"),
])
def test_config_files_empty_wrong_types_and_unknown_keys(tmp_path, text, message):
    from mstar_core.errors import ConfigError

    path = tmp_path / "c.toml"
    path.write_text(text)
    if message is None:
        assert load_config(path) == Config()
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(path)
