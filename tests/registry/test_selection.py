"""Selection by name and by ``auto`` on faked machines (CPU, sm80, sm90, gfx942), with the real
backends' declared data and probes. The wrapper references point at the reference classes so
these tests judge selection alone, whichever wrapper modules exist."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

import mstar_fa3.probe
from mstar_core import (
    AttentionFeatures,
    BackendSpec,
    BackendUnavailable,
    Registry,
    dense_or_flashinfer,
    dense_selection,
    select_backend,
)
from mstar_core.backends.reference import ReferencePrefixedPrefillWrapper
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.errors import InputError, InputTypeError
from mstar_core.registry import auto_order, get_registry, resolve_requested
from mstar_fa3.plugin import FA3
from mstar_flashinfer.plugin import FLASHINFER
from mstar_rocm.plugin import AITER

PAGED = ("paged_prefill", "paged_decode", "mixed")
ALL_LIBS = {"flashinfer": "0.5.3", "flash_attn_interface": "3.0.0", "aiter": "0.1.7"}
BF16 = torch.bfloat16
F32 = torch.float32


def on_reference(spec: BackendSpec) -> BackendSpec:
    return replace(spec, provides={c: REFERENCE.provides[c] for c in spec.provides})


@pytest.fixture
def reg():
    r = Registry(discover=False)
    r.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    for spec, dist in ((FLASHINFER, "mstar-flashinfer"), (FA3, "mstar-fa3"), (AITER, "mstar-rocm")):
        r.register(on_reference(spec), distribution=dist, version="0.1.0")
    return r


@pytest.fixture
def fa3_kernel(monkeypatch):
    """The FA3 probe's tiny call, faked: ``set(reasons)``; records the devices it ran on."""
    calls: list[str] = []

    def set_result(reasons: list[str]) -> list[str]:
        def tiny_call(device):
            calls.append(str(device))
            return list(reasons)

        monkeypatch.setattr(mstar_fa3.probe, "tiny_call", tiny_call)
        return calls

    return set_result


def pick(reg, caps, device="cuda", dtype=BF16, head_dim=128, **kw):
    return select_backend(capabilities=caps, requested="auto", device=device, dtype=dtype, head_dim=head_dim,
                          registry=reg, **kw)


# -- auto ----------------------------------------------------------------------------------------

def test_auto_on_cpu_picks_the_reference_and_says_why_not_the_others(reg, caplog):
    caplog.set_level(logging.INFO, logger="mstar.registry")
    sel = pick(reg, PAGED, device="cpu", dtype=torch.float32)
    assert sel.name == "reference" and sel.requested == "auto"
    assert set(sel.classes) == set(PAGED)
    assert sel.classes["paged_decode"].__name__ == "ReferenceDecodeWrapper"
    assert list(sel.rejected) == ["flashinfer", "fa3"]
    assert "runs on cuda, not on cpu" in sel.rejected["flashinfer"]
    assert "runs on cuda, not on cpu" in sel.rejected["fa3"]
    assert any("flashinfer is not installed" in r for r in sel.rejected["flashinfer"])
    assert "auto picked attention backend 'reference'" in caplog.text and "flashinfer: runs on cuda" in caplog.text

    ragged = pick(reg, ("prefixed_ragged",), device="cpu", dtype=torch.float32)
    assert ragged.name == "reference"
    assert list(ragged.rejected) == ["fa3", "rocm", "flashinfer"]  # the dense rule's order: FA3, AITER, FlashInfer


def test_auto_sm80_flashinfer_everywhere_fa3_has_no_kernel(reg, fake_gpu, fake_installed, fa3_kernel):
    fake_gpu("sm80")
    fake_installed(ALL_LIBS)
    calls = fa3_kernel([])
    assert pick(reg, PAGED).name == "flashinfer"
    sel = pick(reg, ("prefixed_ragged",))
    assert sel.name == "flashinfer"
    assert sel.rejected["fa3"] == ["no kernel for sm80 (kernels for: sm90)"]
    assert sel.rejected["rocm"][0] == "runs on rocm, not on cuda"
    assert calls == []  # no tiny call on an architecture FA3 does not declare


def test_auto_sm90_paged_per_capability_from_the_measured_tables(reg, fake_gpu, fake_installed, fa3_kernel):
    """On sm90 both plugins ship measured tables (H200): each paged capability goes to the faster
    there (the tables' own figures decide, so this follows them), and the dense path to FA3."""
    fake_gpu("sm90")
    fake_installed(ALL_LIBS)
    calls = fa3_kernel([])
    sel = pick(reg, PAGED)
    fa3, fi = reg.measured("fa3"), reg.measured("flashinfer")
    for cap in PAGED:
        faster = min(("fa3", fa3), ("flashinfer", fi), key=lambda t: sum(t[1].median_ms[cap].values()))[0]
        assert sel.names[cap] == faster, cap
        assert "measured on NVIDIA H200" in sel.measured[cap]
    assert pick(reg, ("prefixed_ragged",)).name == "fa3"
    assert calls == ["cuda"]


def test_auto_sm90_fa3_whose_tiny_call_fails_falls_back_to_flashinfer(reg, fake_gpu, fake_installed, fa3_kernel):
    fake_gpu("sm90")
    fake_installed(ALL_LIBS)
    fa3_kernel(["FA3 has no working kernel on sm90: tiny call failed (RuntimeError: no kernel image)"])
    sel = pick(reg, ("prefixed_ragged",))
    assert sel.name == "flashinfer"
    assert "tiny call failed" in sel.rejected["fa3"][0]


def test_auto_sm90_with_no_library_installed_is_the_reference(reg, fake_gpu):
    fake_gpu("sm90")
    sel = pick(reg, ("prefixed_ragged",))
    assert sel.name == "reference"
    assert sel.rejected["fa3"] == [
        "flash_attn_interface is not installed (install a FlashAttention-3 build providing flash_attn_interface "
        "(e.g. pip install tokenspeed-fa3))"]
    assert sel.rejected["flashinfer"] == ["flashinfer is not installed (install flashinfer-python>=0.5.3,<=0.7.4)"]


def test_auto_gfx942_aiter_for_dense_reference_for_paged(reg, fake_gpu, fake_installed):
    fake_gpu("gfx942")
    fake_installed(ALL_LIBS)
    sel = pick(reg, ("prefixed_ragged",))
    assert sel.name == "rocm" and list(sel.rejected) == ["fa3"]
    assert sel.rejected["fa3"][0] == "runs on cuda, not on rocm"
    paged = pick(reg, PAGED)
    assert paged.name == "reference"
    assert paged.rejected["flashinfer"][0] == "runs on cuda, not on rocm"


def test_auto_rocm_arch_without_aiter_kernel(reg, fake_gpu, fake_installed):
    fake_gpu("gfx90a")
    fake_installed(ALL_LIBS)
    sel = pick(reg, ("prefixed_ragged",))
    assert sel.name == "reference"
    assert sel.rejected["rocm"] == ["no kernel for gfx90a (kernels for: gfx942, gfx950)"]


def test_flashinfer_older_than_0_5_is_refused(reg, fake_gpu, fake_installed):
    fake_gpu("sm90")
    fake_installed({"flashinfer": "0.4.1"})
    sel = pick(reg, PAGED)
    assert sel.name == "reference"
    assert sel.rejected["flashinfer"] == ["flashinfer-python 0.4.1 is too old (0.5.3 or newer is required)"]


def test_auto_head_dim_and_dtype_decide_too(reg, fake_gpu, fake_installed, fa3_kernel):
    fake_gpu("sm90")
    fake_installed(ALL_LIBS)
    fa3_kernel([])
    paged = pick(reg, PAGED, head_dim=96)
    assert paged.name == "fa3"  # FA3 takes multiples of 8
    assert paged.rejected["flashinfer"] == ["head_dim 96 is not supported (supported: 64, 128, 256)"]
    assert pick(reg, ("prefixed_ragged",), head_dim=96).name == "fa3"
    assert pick(reg, PAGED, head_dim=100).name == "reference"
    odd = pick(reg, ("prefixed_ragged",), head_dim=100)
    assert odd.name == "reference"
    assert odd.rejected["fa3"] == ["head_dim 100 is not supported (supported: multiples of 8 up to 256)"]
    f32 = pick(reg, PAGED, dtype=torch.float32)
    assert f32.name == "reference"
    assert "dtype float32 is not supported (supported: float16, bfloat16)" in f32.rejected["flashinfer"]


def test_auto_order_puts_third_party_plugins_before_the_reference(reg):
    reg.register(BackendSpec(name="toy", provides={"paged_decode": REFERENCE.provides["paged_decode"],
                                                   "bounded": REFERENCE.provides["bounded"]}, priority=1))
    reg.register(BackendSpec(name="zzz", provides={"paged_decode": REFERENCE.provides["paged_decode"]}, priority=5))
    assert auto_order(("paged_decode",), reg) == ["flashinfer", "zzz", "toy", "fa3", "reference"]
    assert auto_order(("bounded",), reg) == ["toy", "reference"]
    assert auto_order(PAGED, reg) == ["flashinfer", "fa3", "reference"]  # zzz/toy lack prefill and mixed
    assert auto_order(("prefixed_ragged",), reg) == ["fa3", "rocm", "flashinfer", "reference"]


def test_auto_order_follows_each_capabilitys_declared_priority(reg):
    ragged, decode = REFERENCE.provides["prefixed_ragged"], REFERENCE.provides["paged_decode"]
    reg.register(BackendSpec(name="dense1st", provides={"prefixed_ragged": ragged, "paged_decode": decode},
                             priority={"prefixed_ragged": 1000}, api_version="2.0"))
    assert auto_order(("prefixed_ragged",), reg) == ["dense1st", "fa3", "rocm", "flashinfer", "reference"]
    assert auto_order(("paged_decode",), reg) == ["flashinfer", "dense1st", "fa3", "reference"]  # left out: 0
    # several capabilities: the first one's priority, then the next's (dense1st and fa3 are level on decode)
    assert auto_order(("paged_decode", "prefixed_ragged"), reg) == ["flashinfer", "dense1st", "fa3", "reference"]
    assert auto_order(("prefixed_ragged", "paged_decode"), reg) == ["dense1st", "fa3", "flashinfer", "reference"]


def test_the_reference_is_last_whatever_it_declares():
    reg = Registry(discover=False)
    reg.register(replace(REFERENCE, priority=10**6))
    reg.register(BackendSpec(name="low", provides={"bounded": REFERENCE.provides["bounded"]}, priority=-5))
    assert auto_order(("bounded",), reg) == ["low", "reference"]


@pytest.mark.parametrize("priority, error, match", [
    ({"bounded": 1}, InputError, r"priority names capabilities it does not provide: \['bounded'\]"),
    ({"paged_decode": 1.5}, InputTypeError, r"priority\['paged_decode'\] must be an int"),
    ({"paged_decode": True}, InputTypeError, r"priority\['paged_decode'\] must be an int"),
    ("high", InputTypeError, "priority must be an int or a mapping capability -> int"),
])
def test_backend_spec_checks_its_priority(priority, error, match):
    with pytest.raises(error, match=match):
        BackendSpec(name="p", provides={"paged_decode": REFERENCE.provides["paged_decode"]}, priority=priority,
                    api_version="2.0")


def test_a_priority_mapping_is_copied_and_read_per_capability():
    table = {"paged_decode": 7}
    spec = BackendSpec(name="p", provides={"paged_decode": REFERENCE.provides["paged_decode"],
                                           "mixed": REFERENCE.provides["mixed"]}, priority=table, api_version="2.0")
    table["paged_decode"] = 0
    assert (spec.priority_for("paged_decode"), spec.priority_for("mixed")) == (7, 0)
    assert BackendSpec(name="q", provides={}, priority=3).priority_for("mixed") == 3


def test_auto_skips_a_backend_whose_wrapper_fails_to_import(reg):
    reg.register(BackendSpec(name="ghost", provides={"bounded": "mstar_no_such_module:wrapper"},
                             devices=("cpu",), dtypes=(torch.float32,)))
    sel = pick(reg, ("bounded",), device="cpu", dtype=torch.float32)
    assert sel.name == "reference"
    assert "its bounded wrapper mstar_no_such_module:wrapper cannot be loaded (ModuleNotFoundError" \
        in sel.rejected["ghost"][0]


def test_auto_when_nothing_can_run_raises_with_every_reason(reg):
    with pytest.raises(BackendUnavailable, match="no attention backend can run here") as e:
        pick(reg, ("paged_decode",), device="cpu", dtype=torch.int8)
    # every backend that provides paged_decode, with its reasons; rocm does not provide it
    assert set(e.value.reasons) == {"flashinfer", "fa3", "reference"}
    assert "dtype int8 is not supported" in e.value.reasons["reference"][0]
    assert "| reference: dtype int8 is not supported" in str(e.value)
    assert e.value.known == ["fa3", "flashinfer", "reference", "rocm"]


def test_auto_with_no_backend_providing_the_capability_says_so():
    reg = Registry(discover=False)
    reg.register(cpu_spec("toy"))  # bounded alone
    with pytest.raises(BackendUnavailable, match="Reasons: no registered backend provides paged_decode. Known "
                                                 "backends: toy.") as e:
        pick(reg, ("paged_decode",), device="cpu", dtype=F32)
    assert e.value.reasons == {}


# -- by name -------------------------------------------------------------------------------------

def test_by_name(reg, fake_gpu, fake_installed):
    fake_gpu("sm90")
    fake_installed(ALL_LIBS)
    sel = select_backend(PAGED, requested="flashinfer", device="cuda", dtype=BF16, head_dim=128, registry=reg)
    assert sel.name == "flashinfer" and sel.source == "argument" and sel.rejected == {}
    assert sel.backend.distribution == "mstar-flashinfer"
    assert sel.capturable == PAGED


def test_by_name_that_cannot_run_here(reg):
    with pytest.raises(BackendUnavailable) as e:
        select_backend(("prefixed_ragged",), requested="fa3", device="cpu", dtype=torch.float32, registry=reg)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "'fa3' (mstar-fa3 0.1.0, from argument) cannot run here" in msg
    assert "runs on cuda, not on cpu" in msg and "flash_attn_interface is not installed" in msg
    assert "Backends that can: reference;" in msg
    assert "known backends: fa3, flashinfer, reference, rocm" in msg
    assert e.value.available == ["reference"]


def test_by_name_with_a_head_dim_it_cannot_run(reg, fake_gpu, fake_installed):
    fake_gpu("sm90")
    fake_installed(ALL_LIBS)
    with pytest.raises(BackendUnavailable, match=r"head_dim 80 is not supported \(supported: 64, 128, 256\)") as e:
        select_backend(PAGED, requested="flashinfer", device="cuda", dtype=BF16, head_dim=80, registry=reg)
    assert e.value.available == ["reference"]


def test_unknown_name_lists_the_known_ones(reg):
    with pytest.raises(BackendUnavailable) as e:
        select_backend(PAGED, requested="nope", device="cpu", registry=reg)
    msg = str(e.value)
    assert "'nope'" in msg and "is unknown" in msg
    assert "Known backends: fa3, flashinfer, reference, rocm" in msg
    assert ("can run here (device cpu, dtype float32, head_dim 64, capabilities paged_prefill, paged_decode, mixed): "
            "reference") in msg


def test_unknown_name_whose_plugin_failed_says_so(fake_entry_points, make_ep):
    fake_entry_points(make_ep("fa3", "mstar_fa3_gone.plugin", "mstar-fa3", "0.1.0"))
    reg = Registry()
    with pytest.raises(BackendUnavailable, match=r"its plugin failed: plugin 'fa3' \(mstar-fa3 0.1.0\) failed at load"):
        select_backend(("prefixed_ragged",), requested="fa3", device="cpu", registry=reg)


# -- where the name comes from --------------------------------------------------------------------

def test_env_overrides_config_and_says_so(reg, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mstar.registry")
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "reference")
    sel = select_backend(PAGED, device="cpu", config={"attention": {"backend": "flashinfer"}}, registry=reg)
    assert sel.name == "reference" and sel.source == "env MSTAR_ATTENTION_BACKEND"
    assert "MSTAR_ATTENTION_BACKEND=reference overrides the config's backend 'flashinfer'" in caplog.text


def test_env_warns_only_where_it_overrides_another_configured_name(reg, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mstar.registry")
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "reference")

    def override_levels(requested):
        caplog.clear()
        assert select_backend(PAGED, requested=requested, device="cpu", registry=reg).name == "reference"
        return [r.levelname for r in caplog.records if "overrides" in r.getMessage()]

    for same in (None, "auto", "reference", " reference "):  # nothing configured, or nothing else
        assert override_levels(same) == ["INFO"], same
    assert override_levels("flashinfer") == ["WARNING"]


def test_resolve_requested_honors_the_env_unless_told_not_to(monkeypatch):
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", " fa3 ")
    assert resolve_requested(None, None) == ("fa3", "env MSTAR_ATTENTION_BACKEND")
    assert resolve_requested("reference", None, honor_env=False) == ("reference", "argument")
    assert resolve_requested(None, {"attention": {"backend": "flashinfer"}}, honor_env=False) == ("flashinfer",
                                                                                                   "config")
    assert resolve_requested(None, None, honor_env=False) == ("auto", "default")


def test_env_naming_an_unknown_backend_fails_clearly(reg, monkeypatch):
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "nope")
    with pytest.raises(BackendUnavailable, match=r"'nope' \(from env MSTAR_ATTENTION_BACKEND\) is unknown"):
        select_backend(PAGED, device="cpu", registry=reg)


def test_env_overrides_the_requested_argument_too(reg, monkeypatch, caplog):
    """``requested`` (what a manager spec's "backend" passes) counts as config: an
    operator's MSTAR_ATTENTION_BACKEND wins over it, and the log says what it overrode."""
    caplog.set_level(logging.INFO, logger="mstar.registry")
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "reference")
    sel = select_backend(PAGED, requested="flashinfer", device="cpu", registry=reg)
    assert (sel.name, sel.source) == ("reference", "env MSTAR_ATTENTION_BACKEND")
    assert "MSTAR_ATTENTION_BACKEND=reference overrides the argument's backend 'flashinfer'" in caplog.text
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "nope")
    with pytest.raises(BackendUnavailable, match=r"'nope' \(from env MSTAR_ATTENTION_BACKEND\) is unknown"):
        select_backend(PAGED, requested="reference", device="cpu", registry=reg)


def test_argument_without_env_beats_config(reg, monkeypatch):
    monkeypatch.delenv("MSTAR_ATTENTION_BACKEND", raising=False)
    sel = select_backend(PAGED, requested="reference", device="cpu", config={"attention": {"backend": "fa3"}},
                         registry=reg)
    assert (sel.name, sel.source) == ("reference", "argument")


def test_config_mapping_and_toml_file(reg, tmp_path):
    sel = select_backend(PAGED, device="cpu", config={"attention": {"backend": "reference"}}, registry=reg)
    assert (sel.name, sel.source) == ("reference", "config")
    path = tmp_path / "engine.toml"
    path.write_text('[attention]\nbackend = "fa3"\n')
    with pytest.raises(BackendUnavailable, match="'fa3' .*from config"):
        select_backend(("prefixed_ragged",), device="cpu", config=path, registry=reg)
    path.write_text('[attention]\nbackend = "auto"\n')
    assert select_backend(PAGED, device="cpu", config=str(path), registry=reg).requested == "auto"
    assert select_backend(PAGED, device="cpu", config={}, registry=reg).source == "default"
    with pytest.raises(ValueError, match="unknown table 'model'"):
        select_backend(PAGED, device="cpu", config={"model": {}}, registry=reg)


def test_bad_config_files_and_values_are_named(reg, tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ValueError, match=r"config file '.*nope.toml' does not exist"):
        select_backend(PAGED, device="cpu", config=missing, registry=reg)
    broken = tmp_path / "broken.toml"
    broken.write_text("[attention\nbackend = 1\n")
    with pytest.raises(ValueError, match=r"config file '.*broken.toml' is not valid TOML"):
        select_backend(PAGED, device="cpu", config=broken, registry=reg)
    with pytest.raises(ValueError, match=r"config: attention.backend must be a string .* got 3"):
        select_backend(PAGED, device="cpu", config={"attention": {"backend": 3}}, registry=reg)


def test_dense_rule_is_the_rule_whatever_the_env_says(reg, monkeypatch):
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "fa3")
    assert dense_selection("cpu", registry=reg).name == "reference"
    with pytest.raises(BackendUnavailable, match="from env MSTAR_ATTENTION_BACKEND"):
        select_backend(("prefixed_ragged",), device="cpu", registry=reg)  # a manager's selection obeys it


def test_the_dense_rule_reads_the_process_wide_registry_by_default():
    sel = dense_selection("cpu")
    assert sel.name == "reference" and dense_selection("cpu", registry=get_registry()) is sel  # its cached answer


def test_clear_probe_cache_also_forgets_the_dense_rule(reg, fake_gpu, fake_installed, fa3_kernel):
    fake_gpu("sm90")
    fake_installed({})
    assert dense_selection("cuda", registry=reg).name == "reference"
    fake_installed(ALL_LIBS)  # a kernel library installed at run time
    fa3_kernel([])
    assert dense_selection("cuda", registry=reg).name == "reference"  # cached
    reg.clear_probe_cache()
    assert dense_selection("cuda", registry=reg).name == "fa3"


def test_unknown_capability_is_refused(reg):
    with pytest.raises(ValueError, match="paged_everything"):
        select_backend(("paged_everything",), registry=reg)


# -- dense_or_flashinfer ------------------------------------------------------------------------

@pytest.mark.parametrize("arch, libs, expected", [
    ("sm90", ALL_LIBS, "fa3"),
    ("sm80", ALL_LIBS, "flashinfer"),
    ("gfx942", ALL_LIBS, "rocm"),
    ("sm90", {"flashinfer": "0.5.3"}, "flashinfer"),
    ("sm90", {}, "reference"),
])
def test_dense_or_flashinfer(reg, fake_gpu, fake_installed, fa3_kernel, arch, libs, expected, caplog):
    caplog.set_level(logging.INFO, logger="mstar.registry")
    fake_gpu(arch)
    fake_installed(libs)
    fa3_kernel([])
    sel = dense_selection("cuda", registry=reg)
    assert sel.name == expected
    # every backend is remapped onto the reference classes here, so the class says nothing: the
    # log line says which backend dense_or_flashinfer itself chose
    dense_or_flashinfer("cuda", registry=reg)
    assert f"dense_or_flashinfer(cuda:0): {expected}" in caplog.text


def test_dense_or_flashinfer_on_cpu_is_the_reference_and_cached(reg, fa3_kernel):
    calls = fa3_kernel([])
    assert dense_or_flashinfer("cpu", registry=reg) is ReferencePrefixedPrefillWrapper
    assert dense_selection("cpu", registry=reg) is dense_selection("cpu", registry=reg)
    assert calls == []


def test_dense_probe_runs_once_per_device(reg, fake_gpu, fake_installed, fa3_kernel):
    fake_gpu("sm90")
    fake_installed(ALL_LIBS)
    calls = fa3_kernel([])
    for head_dim in (64, 128, 64):
        assert dense_selection("cuda", dtype=BF16, head_dim=head_dim, registry=reg).name == "fa3"
    assert calls == ["cuda"]


# -- attention features --------------------------------------------------------------------------

SINK_REASON = "does not support feature sink_logits (learned per-head sink logits in the softmax denominator) in"
SOFT_CAP_REASON = "does not support feature soft_cap (logit soft-cap (soft_cap * tanh(scores / soft_cap))) in"


def test_auto_sm90_sink_logits_keep_the_paged_picks_and_with_soft_cap_fall_back(reg, fake_gpu, fake_installed,
                                                                              fa3_kernel, caplog):
    """Both plugins run sink logits on the paged paths, so the plain picks stand; with soft-cap too,
    FlashInfer is passed over for the combination (its sink variant has no soft-cap) and FA3 for
    soft-cap (compiled out), naming each, and the reference serves."""
    fake_gpu("sm90")
    fake_installed(ALL_LIBS)
    fa3_kernel([])
    f = AttentionFeatures(sink_logits=True)
    assert pick(reg, PAGED, features=f).names == pick(reg, PAGED).names
    both = AttentionFeatures(sink_logits=True, soft_cap=30.0)
    with caplog.at_level(logging.INFO, logger="mstar.registry"):
        sel = pick(reg, PAGED, features=both)
    assert sel.name == "reference"
    assert sel.rejected["flashinfer"] == [
        "does not support features sink_logits with soft_cap together in paged_prefill, paged_decode, mixed"]
    assert sel.rejected["fa3"] == [f"{SOFT_CAP_REASON} paged_prefill, paged_decode, mixed"]
    assert "flashinfer: does not support features sink_logits with soft_cap together in paged_prefill" in caplog.text
    # the dense path: FA3 declares sink logits, so it keeps its place
    assert pick(reg, ("prefixed_ragged",), features=f).name == "fa3"


def test_auto_sm90_fp8_soft_cap_stays_on_flashinfer(reg, fake_gpu, fake_installed, fa3_kernel):
    fake_gpu("sm90")
    fake_installed(ALL_LIBS)
    fa3_kernel([])
    f = AttentionFeatures(kv_dtype="fp8_e4m3", soft_cap=30.0, layer_windows=(4096, -1),
                          decode_query_tokens=4)
    assert pick(reg, PAGED, features=f).name == "flashinfer"
    # soft-cap on the dense path: the tested FA3 build has none, FlashInfer's ragged prefill has it
    sel = pick(reg, ("prefixed_ragged",), features=f)
    assert sel.name == "flashinfer"
    assert sel.rejected["fa3"] == [("does not support feature soft_cap (logit soft-cap (soft_cap * tanh(scores / "
                                    "soft_cap))) in prefixed_ragged")]


def test_named_backend_lacking_a_feature_names_it_and_who_can(reg):
    with pytest.raises(BackendUnavailable) as e:
        select_backend(capabilities=("bounded",), requested="reference", device="cpu",
                       features=AttentionFeatures(soft_cap=30.0, sink_logits=True), registry=reg)
    msg = str(e.value)
    assert "features soft_cap, sink_logits" in msg  # the request, as the error states it
    assert e.value.reasons["reference"] == [
        "does not support feature soft_cap (logit soft-cap (soft_cap * tanh(scores / soft_cap))) in bounded",
        f"{SINK_REASON} bounded"]


def test_features_must_be_an_attention_features(reg):
    with pytest.raises(TypeError, match=r"features must be an AttentionFeatures or None, got dict"):
        select_backend(device="cpu", features={"soft_cap": 30}, registry=reg)


@pytest.mark.parametrize("features, match", [
    ({"paged_decode": ("soft_cap",)}, r"features names capabilities it does not provide: \['paged_decode'\]"),
    ({"prefixed_ragged": ("softcap",)}, r"features\['prefixed_ragged'\] names unknown features \['softcap'\]; known:"),
    ({"prefixed_ragged": "soft_cap"}, r"must be a tuple of feature names, got the string 'soft_cap'"),
])
def test_backend_spec_checks_its_feature_declarations(features, match):
    with pytest.raises((ValueError, TypeError), match=match):
        BackendSpec(name="toy", provides={"prefixed_ragged": "m:c"}, features=features)


def test_plain_attention_is_asked_of_nobody(reg):
    assert AttentionFeatures().requested() == ()
    # one window for every layer needs no per-layer plans: it is a plain window, not the feature
    assert AttentionFeatures(layer_windows=(64, 64)).requested() == ()
    sel = pick(reg, ("bounded",), device="cpu", dtype=torch.float32, features=AttentionFeatures(layer_windows=(4, -1)))
    assert sel.name == "reference"  # windows per layer do not reach the bounded kernels


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


def test_a_requested_name_with_blanks_around_it_selects_that_backend():
    """A backend name given with blanks around it (``" reference "``, as a config line or an
    argument may hold it) names that backend."""
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    reg.register(cpu_spec("toy"))
    for requested, want in ((" reference ", "reference"), ("toy\n", "toy")):
        sel = select_backend(("bounded",), requested=requested, device="cpu", dtype=F32, head_dim=64, registry=reg)
        assert sel.name == want and sel.requested == want and sel.source == "argument"


# -- the dense path's features --------------------------------------------------------------------

def test_dense_rule_judges_the_features_that_reach_the_dense_path(reg, fake_gpu, fake_installed, fa3_kernel):
    fake_gpu("sm80")
    fake_installed(ALL_LIBS)
    fa3_kernel([])
    sinks = AttentionFeatures(sink_logits=True)
    assert dense_selection("cuda", BF16, 128, registry=reg).name == "flashinfer"
    sel = dense_selection("cuda", BF16, 128, registry=reg, features=sinks)  # cached apart from the plain answer
    assert sel.name == "reference"
    assert sel.rejected["flashinfer"] == [f"{SINK_REASON} prefixed_ragged"]
    assert dense_or_flashinfer("cuda", dtype=BF16, head_dim=128, registry=reg, features=sinks) \
        is ReferencePrefixedPrefillWrapper
    fake_gpu("sm90")
    reg.clear_probe_cache()
    soft_cap = AttentionFeatures(soft_cap=30.0)
    assert dense_selection("cuda", BF16, 128, registry=reg).name == "fa3"
    assert dense_selection("cuda", BF16, 128, registry=reg, features=soft_cap).name == "flashinfer"
    # An FP8 cache reaches the dense path's wrappers dequantised: it is asked of none of them
    fp8 = AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=0.5)
    sel = dense_selection("cuda", BF16, 128, registry=reg, features=fp8)
    assert sel.name == "fa3" and sel.rejected == {}
    with pytest.raises(TypeError, match="features must be an AttentionFeatures or None, got dict"):
        dense_selection("cuda", registry=reg, features={"sink_logits": True})


def test_auto_for_the_dense_path_asks_third_party_backends_only_what_reaches_them():
    """Three CPU backends for the dense path: what each declares for prefixed_ragged decides
    where a feature that reaches it is asked; FP8 is asked of none (the dense manager hands the
    wrappers K/V dequantised), whether a backend declares it there or not."""
    ragged = {"prefixed_ragged": REFERENCE.provides["prefixed_ragged"]}
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0.1.0")
    for name, declared, priority in (("plain3p", (), 9), ("fp8decl", ("fp8_e4m3",), 5),
                                     ("sinks3p", ("sink_logits",), 1)):
        reg.register(BackendSpec(name=name, provides=ragged, devices=("cpu",), dtypes=(F32,), priority=priority,
                                 features={"prefixed_ragged": declared}), distribution=f"{name}-mstar")
    fp8 = AttentionFeatures(kv_dtype="fp8_e4m3")
    for features in (None, fp8):
        sel = pick(reg, ("prefixed_ragged",), device="cpu", dtype=F32, features=features)
        assert sel.name == "plain3p" and sel.rejected == {}
        assert dense_selection("cpu", F32, 128, registry=reg, features=features).name == "plain3p"
    sel = pick(reg, ("prefixed_ragged",), device="cpu", dtype=F32, features=AttentionFeatures(sink_logits=True))
    assert sel.name == "sinks3p"
    assert list(sel.rejected) == ["plain3p", "fp8decl"]
    assert sel.rejected["plain3p"] == [f"{SINK_REASON} prefixed_ragged"]
