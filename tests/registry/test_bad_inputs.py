"""Bad inputs to the registry refused at the boundary: a type or value that fits, a
message that names the bad value and what is allowed, and nothing changed."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from mstar_core import (
    BackendSpec,
    BackendUnavailable,
    HeadDims,
    Registry,
    select_backend,
)
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.registry import config_backend, resolve_requested
from mstar_core.registry.discovery import ENV_STRICT, strict_from_env

PAGED = ("paged_prefill", "paged_decode", "mixed")
CPU = torch.device("cpu")
F32 = torch.float32


@pytest.fixture
def reg():
    r = Registry(discover=False)
    r.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    return r


# -- requested -----------------------------------------------------------------------------------

@pytest.mark.parametrize("requested", [3, ["reference"], b"reference", 2.5], ids=["int", "list", "bytes", "float"])
def test_a_requested_name_that_is_not_a_string_is_a_type_error(reg, requested):
    with pytest.raises(TypeError) as e:
        select_backend(capabilities=PAGED, requested=requested, device=CPU, dtype=F32, registry=reg)
    msg = str(e.value)
    assert repr(requested) in msg and type(requested).__name__ in msg
    assert "backend name string or 'auto'" in msg
    with pytest.raises(TypeError, match=r"backend name string or 'auto'.* got " + type(requested).__name__):
        resolve_requested(requested, None)


def test_a_wrong_requested_type_is_named_before_the_config_is_read(reg, tmp_path):
    with pytest.raises(TypeError, match="requested backend must be a backend name string"):
        select_backend(capabilities=PAGED, requested=3, device=CPU, dtype=F32, config=tmp_path / "nope.toml",
                       registry=reg)


def test_other_argument_types_are_named(reg):
    with pytest.raises(TypeError, match=r"got the string 'paged_decode'"):
        select_backend(capabilities="paged_decode", device=CPU, registry=reg)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype .* got str 'float32'"):
        select_backend(capabilities=PAGED, device=CPU, dtype="float32", registry=reg)
    with pytest.raises(TypeError, match=r"head_dim must be an int or None, got float 64.0"):
        select_backend(capabilities=PAGED, device=CPU, dtype=F32, head_dim=64.0, registry=reg)
    assert select_backend(capabilities=PAGED, device=CPU, dtype=F32, registry=reg).name == "reference"


@pytest.mark.parametrize("capabilities", [(), ("paged_decode", "paged_everything")], ids=["empty", "unknown"])
def test_capabilities_must_be_a_non_empty_subset_of_the_known_ones(reg, capabilities):
    with pytest.raises(ValueError, match=r"capabilities must be a non-empty subset of \[.*'paged_decode'.*\], got "
                                         + re.escape(str(list(capabilities)))):
        select_backend(capabilities=capabilities, device=CPU, dtype=F32, registry=reg)


def test_the_registry_is_a_registry_or_none_for_the_process_wide_one(monkeypatch):
    with pytest.raises(TypeError, match="registry must be a Registry or None, got dict"):
        select_backend(capabilities=PAGED, device=CPU, dtype=F32, registry={"reference": REFERENCE})
    only_toy = Registry(discover=False)
    only_toy.register(BackendSpec(name="toy", provides={"paged_decode": REFERENCE.provides["paged_decode"]},
                                  devices=("cpu",), dtypes=(F32,)))
    monkeypatch.setattr("mstar_core.registry.registry._default", only_toy)
    assert select_backend(capabilities=("paged_decode",), device=CPU, dtype=F32).name == "toy"


# -- config --------------------------------------------------------------------------------------

def test_a_config_file_that_is_not_utf8_names_the_file_and_the_byte(tmp_path, reg):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[attention]\nbackend = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ValueError) as e:
        config_backend(path)
    msg = str(e.value)
    assert str(path) in msg and "not UTF-8" in msg and r"b'\xe9'" in msg and "offset 26" in msg
    with pytest.raises(ValueError, match="not UTF-8"):
        select_backend(capabilities=PAGED, device=CPU, dtype=F32, config=str(path), registry=reg)


def test_a_config_path_that_is_a_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=rf"config file '{tmp_path}' cannot be read \(IsADirectoryError"):
        config_backend(tmp_path)


@pytest.mark.parametrize("config", [["attention", {"backend": "reference"}], ("reference",), 3, 2.0],
                         ids=["list", "tuple", "int", "float"])
def test_a_config_that_is_not_a_table_is_refused_with_the_expected_shape(config, reg):
    with pytest.raises(ValueError) as e:
        config_backend(config)
    msg = str(e.value)
    assert type(config).__name__ in msg and repr(config)[:20] in msg
    assert "{\"attention\": {\"backend\": NAME" in msg
    with pytest.raises(ValueError, match="must be a table"):
        select_backend(capabilities=PAGED, device=CPU, dtype=F32, config=config, registry=reg)


def test_an_attention_entry_that_is_not_a_table_names_what_it_is():
    with pytest.raises(ValueError, match=r"'attention' must be a table shaped .* got list \['fa3'\]"):
        config_backend({"attention": ["fa3"]})
    assert config_backend({"attention": {"backend": "fa3"}}) == "fa3"
    assert config_backend({}) is None


# -- MSTAR_STRICT_PLUGINS --------------------------------------------------------------------------

@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("YES", True), (" On ", True),
    ("0", False), ("False", False), ("no", False), ("OFF", False), ("", False), ("  ", False),
])
def test_strict_accepts_the_documented_values(monkeypatch, value, expected):
    monkeypatch.setenv(ENV_STRICT, value)
    assert strict_from_env() is expected
    assert Registry(discover=False).strict is expected


@pytest.mark.parametrize("value", ["maybe", "2", "enabled", "ture"])
def test_strict_refuses_anything_else_naming_variable_value_and_choices(monkeypatch, value):
    monkeypatch.setenv(ENV_STRICT, value)
    with pytest.raises(ValueError) as e:
        Registry(discover=False)
    msg = str(e.value)
    assert f"{ENV_STRICT}={value!r}" in msg
    for allowed in ("1", "true", "yes", "on", "0", "false", "no", "off", "empty"):
        assert allowed in msg
    # an explicit argument does not read the variable
    assert Registry(discover=False, strict=True).strict is True


def test_registry_arguments_of_the_wrong_type(monkeypatch):
    with pytest.raises(TypeError, match=r"strict=.* got 'yes'"):
        Registry(discover=False, strict="yes")
    with pytest.raises(TypeError, match=r"got the string 'flashinfer'"):
        Registry(discover=False, allowlist="flashinfer")


# -- the "backends that can" list ------------------------------------------------------------------
# A refusal lists the backends that could serve the same request. Each fake below differs from
# "good" in exactly one way; only "good" can serve (PAGED, cpu, float32, head_dim 64).

def _fake(name: str, **changes) -> BackendSpec:
    base = BackendSpec(name=name, provides=dict(REFERENCE.provides), devices=("cpu",), dtypes=(F32,),
                       head_dims=HeadDims())
    return replace(base, **changes)


@pytest.fixture
def fakes():
    r = Registry(discover=False)
    r.register(_fake("good"))
    r.register(_fake("wrongdevice", devices=("cuda",)))
    r.register(_fake("nocap", provides={c: REFERENCE.provides[c] for c in ("paged_prefill", "paged_decode")}))
    r.register(_fake("nodtype", dtypes=(torch.bfloat16,)))
    r.register(_fake("nohead", head_dims=HeadDims(values=(128,))))
    return r


def _can_list(msg: str, marker: str) -> list[str]:
    tail = msg.split(marker, 1)[1]
    return [n.strip() for n in tail.split(";")[0].split("(or use")[0].split(",") if n.strip()]


@pytest.mark.parametrize("refused", ["wrongdevice", "nocap", "nodtype", "nohead"])
def test_backends_that_can_filters_by_capability_dtype_and_head_dim(fakes, refused):
    with pytest.raises(BackendUnavailable) as e:
        select_backend(capabilities=PAGED, requested=refused, device=CPU, dtype=F32, head_dim=64, registry=fakes)
    msg = str(e.value)
    assert f"attention backend {refused!r}" in msg
    assert _can_list(msg, "Backends that can: ") == ["good"]
    assert e.value.available == ["good"]


def test_unknown_name_lists_only_backends_that_can_serve_the_request(fakes):
    with pytest.raises(BackendUnavailable) as e:
        select_backend(capabilities=PAGED, requested="nope", device=CPU, dtype=F32, head_dim=64, registry=fakes)
    msg = str(e.value)
    assert "'nope'" in msg and "is unknown" in msg
    assert _can_list(msg, "): ") == ["good"]  # "these can run here (<request>): good (or use 'auto')."
    assert e.value.available == ["good"]


@pytest.mark.parametrize("request_kw,also", [
    (dict(capabilities=("paged_prefill", "paged_decode")), "nocap"),
    (dict(dtype=torch.bfloat16), "nodtype"),
    (dict(head_dim=128), "nohead"),
], ids=["capability", "dtype", "head_dim"])
def test_each_fake_is_listed_once_the_request_fits_it(fakes, request_kw, also):
    """The converse: the one difference is what excluded it, so a request it can serve lists it."""
    kw = dict(capabilities=PAGED, device=CPU, dtype=F32, head_dim=64) | request_kw
    with pytest.raises(BackendUnavailable) as e:
        select_backend(requested="wrongdevice", registry=fakes, **kw)
    assert also in _can_list(str(e.value), "Backends that can: ")
    assert "wrongdevice" not in e.value.available


# -- pins from the environment -------------------------------------------------------------------

def test_a_name_pinned_to_two_distributions_is_refused_naming_both(monkeypatch):
    from mstar_core.errors import InputError
    from mstar_core.registry.discovery import pins_from_env

    monkeypatch.setenv("MSTAR_BACKEND_PINS", "fast=a, other=c ,fast=b")
    with pytest.raises(InputError, match=r"backend 'fast' is pinned twice, to 'a' and to 'b'; pin each name once"):
        pins_from_env()
    monkeypatch.setenv("MSTAR_BACKEND_PINS", "fast=a,fast=a")  # the same pin twice says one thing
    assert pins_from_env() == {"fast": "a"}


# -- unknown names: the install line of a first-party plugin, the closest known name ---------------

@pytest.mark.parametrize("name,line", [
    ("flashinfer", "install it with `pip install ./plugins/flashinfer` in a clone of mstar"),
    ("fa3", "install it with `pip install \"./plugins/fa3[tokenspeed]\"` in a clone of mstar"),
    ("rocm", "install it with `pip install ./plugins/rocm` in a clone of mstar"),
])
def test_an_uninstalled_first_party_backend_names_its_install_line(reg, name, line):
    with pytest.raises(BackendUnavailable) as e:
        select_backend(PAGED, name, CPU, registry=reg, honor_env=False)
    assert f"'{name}' (from argument) is unknown: no installed plugin registers it; it is the mstar-" in str(e.value)
    assert line in str(e.value)


def test_a_backend_left_out_by_the_allowlist_says_so(monkeypatch):
    monkeypatch.setenv("MSTAR_PLUGINS", "")
    r = Registry(discover=False)
    r.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    with pytest.raises(BackendUnavailable) as e:
        select_backend(PAGED, "flashinfer", CPU, registry=r, honor_env=False)
    msg = str(e.value)
    assert "no plugin loaded here registers it (MSTAR_PLUGINS allows only: none)" in msg
    assert "installed already: add mstar-flashinfer to MSTAR_PLUGINS" in msg


@pytest.mark.parametrize("name,close", [("referenc", "reference"), ("flashinfr", "flashinfer"), ("Reference",
                                                                                                  "reference")])
def test_a_misspelled_backend_gets_the_closest_known_name(reg, name, close):
    with pytest.raises(BackendUnavailable, match=rf"no installed plugin registers it \(did you mean '{close}'\?\)"):
        select_backend(PAGED, name, CPU, registry=reg, honor_env=False)


def test_a_name_close_to_nothing_gets_no_guess(reg):
    with pytest.raises(BackendUnavailable) as e:
        select_backend(PAGED, "zzzz", CPU, registry=reg, honor_env=False)
    assert "did you mean" not in str(e.value) and "install it" not in str(e.value)


def test_the_registry_lookup_of_a_misspelled_name_guesses_too(reg):
    from mstar_core.errors import UnknownName

    with pytest.raises(UnknownName, match=r"known: reference \(did you mean 'reference'\?\)"):
        reg.probe("refrence")
