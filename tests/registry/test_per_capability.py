"""Plugin API 1.1: dtypes and head dims declared per capability, a backend's KV layout, each
paged capability from its own pick (auto, a config table, a name per capability), and where
multi-token decode rows run."""

from __future__ import annotations

import logging

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    BackendSpec,
    BackendUnavailable,
    CapabilitySpec,
    HeadDims,
    Registry,
    select_backend,
)
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.errors import ConfigError, UnknownName

PREFILL = "mstar_core.backends.reference:ReferencePrefillWrapper"
DECODE = "mstar_core.backends.reference:ReferenceDecodeWrapper"
MIXED = "mstar_core.backends.reference:ReferenceMixedWrapper"
PAGED = ("paged_prefill", "paged_decode", "mixed")
CPU, F32 = "cpu", torch.float32
MULTI = AttentionFeatures(decode_query_tokens=3)


def spec(name: str, provides=None, **kw) -> BackendSpec:
    kw.setdefault("api_version", "1.1")
    return BackendSpec(name=name, provides=provides or {"paged_decode": DECODE}, devices=("cpu",),
                       dtypes=kw.pop("dtypes", (F32,)), **kw)


def registry(*specs: BackendSpec) -> Registry:
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0")
    for s in specs:
        reg.register(s, distribution=f"{s.name}-kernels", version="1.0")
    return reg


# -- declarations --------------------------------------------------------------------------------

def test_dtypes_and_head_dims_per_capability_are_judged_per_capability():
    s = spec("split", provides={"paged_prefill": PREFILL, "paged_decode": DECODE},
             head_dims=HeadDims(values=(64, 128)),
             per_capability={"paged_decode": CapabilitySpec(dtypes=(torch.float16,), head_dims=HeadDims(values=(64,)))})
    assert s.dtypes_for("paged_decode") == (torch.float16,) and s.dtypes_for("paged_prefill") == (F32,)
    assert s.declared_refusals(("paged_prefill",), F32, 128) == []
    assert s.declared_refusals(("paged_decode",), F32, 128) == [
        "dtype float32 is not supported in paged_decode (supported: float16)",
        "head_dim 128 is not supported in paged_decode (supported: 64)"]
    assert s.declared_refusals(("paged_decode",), torch.float16, 64) == []


def test_head_dims_say_why_they_refuse_one():
    assert HeadDims(values=(64, 128)).refusal(64) is None
    assert HeadDims(values=(64, 128)).refusal(96) == "head_dim 96 is not supported (supported: 64, 128)"
    assert HeadDims(multiple_of=8, maximum=256).refusal(256) is None
    for refused in (0, 100, 264):
        assert HeadDims(multiple_of=8, maximum=256).refusal(refused) == (
            f"head_dim {refused} is not supported (supported: multiples of 8 up to 256)")


def test_the_api_1_1_fields_need_api_1_1_and_are_checked():
    with pytest.raises(ValueError, match=r"per_capability came with plugin API 1.1.*declare api_version='1.1'"):
        spec("old", api_version="1.0", per_capability={"paged_decode": CapabilitySpec(dtypes=(F32,))})
    with pytest.raises(ValueError, match="per_capability names capabilities it does not provide: .'mixed'."):
        spec("x", per_capability={"mixed": CapabilitySpec()})
    with pytest.raises(TypeError, match=r"per_capability\['paged_decode'\] must be a CapabilitySpec"):
        spec("x", per_capability={"paged_decode": {"dtypes": (F32,)}})
    with pytest.raises(TypeError, match="dtypes must be a tuple of torch dtypes"):
        CapabilitySpec(dtypes=F32)
    with pytest.raises(TypeError, match="kv_layout must be a layout name such as 'nhd'"):
        spec("x", kv_layout="")


def test_a_backend_reading_another_kv_layout_is_never_picked_for_the_paged_path():
    hnd = spec("hnd", kv_layout="hnd", priority=5)
    reg = registry(hnd)
    sel = select_backend(PAGED, device=CPU, dtype=F32, registry=reg)
    assert sel.names["paged_decode"] == "reference"
    assert sel.rejected["hnd"] == ["reads KV layout 'hnd'; mstar's paged cache stores 'nhd' "
                                   "([pages, 2, page_size, kv_heads, head_dim], keys at [:, 0], values at [:, 1])"]
    with pytest.raises(BackendUnavailable, match="reads KV layout 'hnd'"):
        select_backend(("paged_decode",), requested="hnd", device=CPU, dtype=F32, registry=reg)


def test_a_1_0_plugin_still_loads_and_serves(fake_module, make_ep, fake_entry_points):
    from mstar_core import hookimpl

    old = BackendSpec(name="legacy", provides={"paged_prefill": PREFILL, "paged_decode": DECODE, "mixed": MIXED},
                      devices=("cpu",), dtypes=(F32,), priority=1,
                      features={"paged_decode": ("multi_token_decode",)})  # api_version left out: 1.0

    @hookimpl
    def hook(register):
        register(old)

    fake_module("legacy_plugin", mstar_register_backends=hook)
    fake_entry_points(make_ep("legacy", "legacy_plugin", "legacy-kernels", "0.3"))
    reg = Registry()
    assert reg.get("legacy").api_version == "1.0" and not reg.failures
    sel = select_backend(PAGED, device=CPU, dtype=F32, registry=reg, features=MULTI)
    assert sel.name == "legacy"
    # 1.0 declared multi-token rows on paged_decode for its prefill wrapper to run: still so
    assert sel.multi_token_wrapper == "paged_prefill"


# -- each capability from its own pick -----------------------------------------------------------

def test_auto_takes_decode_from_a_decode_only_backend_and_the_rest_from_the_reference(caplog):
    reg = registry(spec("dec"))
    with caplog.at_level("INFO", logger="mstar.registry"):
        sel = select_backend(PAGED, device=CPU, dtype=F32, registry=reg)
    assert sel.names == {"paged_prefill": "reference", "paged_decode": "dec", "mixed": "reference"}
    assert sel.name == "reference+dec" and sel.backend_for("paged_decode").name == "dec"
    assert "paged_decode: dec (dec-kernels 1.0)" in caplog.text
    # a capability's own head dims: where decode cannot run, decode stays on the reference
    narrow = spec("narrow", per_capability={"paged_decode": CapabilitySpec(head_dims=HeadDims(values=(64,)))})
    sel = select_backend(PAGED, device=CPU, dtype=F32, head_dim=128, registry=registry(narrow))
    assert sel.names["paged_decode"] == "reference"
    assert sel.rejected_by["paged_decode"]["narrow"] == ["head_dim 128 is not supported in paged_decode "
                                                         "(supported: 64)"]


def test_a_name_for_every_capability_still_takes_them_all_from_it():
    reg = registry(spec("dec"))
    with pytest.raises(BackendUnavailable, match=r"does not provide paged_prefill, mixed"):
        select_backend(PAGED, requested="dec", device=CPU, dtype=F32, registry=reg)


@pytest.mark.parametrize("where", ["argument", "config"])
def test_a_table_names_a_backend_per_capability(where):
    reg = registry(spec("dec"), spec("dec2", priority=9))
    table = {"paged_decode": "dec", "default": "reference"}
    kw = {"requested": table} if where == "argument" else {"config": {"attention": {"backend": table}}}
    sel = select_backend(PAGED, device=CPU, dtype=F32, registry=reg, **kw)
    assert sel.names == {"paged_prefill": "reference", "paged_decode": "dec", "mixed": "reference"}
    assert sel.source == where
    # a capability the table leaves out, with no default: auto (dec2 outranks dec)
    sel = select_backend(PAGED, requested={"mixed": "reference"}, device=CPU, dtype=F32, registry=reg)
    assert sel.names["paged_decode"] == "dec2"


def test_a_table_s_bad_key_or_value_and_a_named_capability_that_cannot_run_are_named():
    reg = registry(spec("dec"))
    with pytest.raises(ConfigError, match=r"unknown key 'paged_decod' \(did you mean 'paged_decode'\?\)"):
        select_backend(PAGED, config={"attention": {"backend": {"paged_decod": "dec"}}}, device=CPU, registry=reg)
    with pytest.raises(ConfigError, match="paged_decode = 3: give a backend name or 'auto'"):
        select_backend(PAGED, requested={"paged_decode": 3}, device=CPU, registry=reg)
    with pytest.raises(BackendUnavailable, match=r"'dec' \(dec-kernels 1.0, from argument, for paged_decode\) "
                                                 r"cannot run here.*dtype float16 is not supported"):
        select_backend(PAGED, requested={"paged_decode": "dec"}, device=CPU, dtype=torch.float16, registry=reg)


def test_the_environment_overrides_a_table(monkeypatch):
    reg = registry(spec("dec"))
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "reference")
    sel = select_backend(PAGED, requested={"paged_decode": "dec"}, device=CPU, dtype=F32, registry=reg)
    assert sel.name == "reference" and sel.source == "env MSTAR_ATTENTION_BACKEND"


# -- multi-token decode rows ---------------------------------------------------------------------

def test_multi_token_rows_run_where_a_pick_declares_them():
    reg = registry()
    # the reference runs them on its decode wrapper
    assert select_backend(PAGED, device=CPU, dtype=F32, registry=reg, features=MULTI).multi_token_wrapper == \
        "paged_decode"
    # a decode-only backend without them keeps decode; the reference's prefill wrapper runs the rows
    plain_dec = spec("dec", priority=3)
    sel = select_backend(PAGED, device=CPU, dtype=F32, registry=registry(plain_dec), features=MULTI)
    assert sel.names["paged_decode"] == "dec" and sel.multi_token_wrapper == "paged_prefill"
    # a prefill backend that does not run them is passed over for one that does
    pre0 = spec("pre0", provides={"paged_prefill": PREFILL}, priority=3)
    sel = select_backend(PAGED, device=CPU, dtype=F32, registry=registry(plain_dec, pre0), features=MULTI)
    assert sel.names == {"paged_prefill": "reference", "paged_decode": "dec", "mixed": "reference"}
    assert "on its paged_prefill wrapper" in sel.rejected_by["paged_prefill"]["pre0"][0]
    # ... unless no prefill candidate runs them: then decode moves to one that does
    pre = spec("pre", provides={"paged_prefill": PREFILL, "paged_decode": DECODE}, priority=2,
               features={"paged_decode": ("multi_token_decode",)})
    sel = select_backend(PAGED, requested={"paged_prefill": "pre0"}, device=CPU, dtype=F32,
                         registry=registry(plain_dec, pre0, pre), features=MULTI)
    assert sel.names["paged_decode"] == "pre" and sel.multi_token_wrapper == "paged_decode"
    assert "on its paged_decode wrapper" in sel.rejected_by["paged_decode"]["dec"][0]
    # named picks that cannot run them: refused, naming both
    with pytest.raises(BackendUnavailable, match=r"3 query tokens per decode row.*paged_prefill: pre0, "
                                                 r"paged_decode: dec"):
        select_backend(PAGED, requested={"paged_decode": "dec", "paged_prefill": "pre0"}, device=CPU, dtype=F32,
                       registry=registry(plain_dec, pre0), features=MULTI)


def test_a_prefill_pick_no_candidate_could_replace_is_not_listed_as_passed_over():
    """No prefill candidate runs multi-token rows, so decode moves to one that does: the prefill
    pick stays, and is not among those passed over for prefill."""
    reg = Registry(discover=False)  # no reference: nothing else serves prefill
    both = spec("both", provides={"paged_prefill": PREFILL, "paged_decode": DECODE, "mixed": MIXED}, priority=5)
    runs = spec("runs", priority=1, features={"paged_decode": ("multi_token_decode",)})
    for s in (both, runs):
        reg.register(s, distribution=f"{s.name}-kernels", version="1.0")
    sel = select_backend(PAGED, device=CPU, dtype=F32, registry=reg, features=MULTI)
    assert sel.names == {"paged_prefill": "both", "paged_decode": "runs", "mixed": "both"}
    assert sel.multi_token_wrapper == "paged_decode"
    assert "both" not in sel.rejected_by["paged_prefill"]
    assert "on its paged_decode wrapper" in sel.rejected_by["paged_decode"]["both"][0]
    assert not any("paged_prefill wrapper" in r for r in sel.rejected.get("both", []))


def test_a_1_0_decode_only_backend_is_refused_for_multi_token_rows_by_name_as_by_auto():
    """Written for 1.0, multi_token_decode on paged_decode meant rows on the backend's prefill
    wrapper; with none, it runs them nowhere: auto passes it over and a name is refused."""
    old = BackendSpec(name="olddec", provides={"paged_decode": DECODE}, devices=("cpu",), dtypes=(F32,), priority=9,
                      features={"paged_decode": ("multi_token_decode",)})  # api_version left out: 1.0
    reg = registry(old)
    assert old.multi_token_wrappers() == ()
    sel = select_backend(("paged_decode",), device=CPU, dtype=F32, registry=reg, features=MULTI)
    assert sel.names == {"paged_decode": "reference"} and sel.multi_token_wrapper == "paged_decode"
    with pytest.raises(BackendUnavailable, match=r"'olddec' .*cannot run here.*does not support feature "
                                                 r"multi_token_decode .* in paged_decode. Backends that can: "
                                                 r"reference"):
        select_backend(("paged_decode",), requested="olddec", device=CPU, dtype=F32, registry=reg, features=MULTI)
    # without multi-token rows it serves decode by name, as before
    assert select_backend(("paged_decode",), requested="olddec", device=CPU, dtype=F32, registry=reg).name == "olddec"


def test_two_query_tokens_per_decode_row_are_multi_token_rows_by_name_and_by_auto():
    reg = registry()
    two = AttentionFeatures(decode_query_tokens=2)
    for requested in ("reference", "auto"):
        sel = select_backend(PAGED, requested=requested, device=CPU, dtype=F32, registry=reg, features=two)
        assert sel.multi_token_wrapper == "paged_decode", requested
    # one token per row asks no wrapper for them, though the reference's decode wrapper runs them
    assert select_backend(PAGED, requested="reference", device=CPU, dtype=F32, registry=reg).multi_token_wrapper \
        is None
    # nor does prefill asked alone, by name
    assert select_backend(("paged_prefill",), requested="reference", device=CPU, dtype=F32, registry=reg,
                          features=MULTI).multi_token_wrapper is None


# -- the two paths' Selection ----------------------------------------------------------------------

def test_a_selection_by_name_and_one_per_capability_answer_the_same_questions():
    reg = registry(spec("dec", capturable=("paged_decode",)))
    by_name = select_backend(PAGED, requested="reference", device=CPU, dtype=F32, registry=reg)
    assert by_name.picks == {} and by_name.rejected_by == {}  # one backend serves every capability
    assert by_name.names == dict.fromkeys(PAGED, "reference")
    assert all(by_name.backend_for(c).name == "reference" for c in PAGED)
    assert by_name.summary == by_name.name == "reference" and by_name.capturable == ()
    split = select_backend(PAGED, device=CPU, dtype=F32, registry=reg)
    assert {c: s.name for c, s in split.picks.items()} == split.names == {
        "paged_prefill": "reference", "paged_decode": "dec", "mixed": "reference"}
    assert split.backend.name == "reference"  # the first capability's
    assert split.summary == "paged_prefill: reference, paged_decode: dec, mixed: reference"
    assert split.capturable == ("paged_decode",)  # each capability by its own pick's declaration
    # every capability named one backend in a table: one backend, as by name
    table = select_backend(PAGED, requested={"default": "reference"}, device=CPU, dtype=F32, registry=reg)
    assert table.name == table.summary == "reference" and table.names == by_name.names
    assert table.classes == by_name.classes


def test_a_decode_only_selection_with_multi_token_rows_keeps_a_decode_pick_that_runs_them_itself():
    """Decode asked alone: no prefill pick to run the rows, so the decode pick must, on a wrapper
    of its own (a 1.1 spec declaring them on its prefill wrapper: there)."""
    on_prefill = spec("onpre", provides={"paged_prefill": PREFILL, "paged_decode": DECODE}, priority=5,
                      features={"paged_prefill": ("multi_token_decode",)})
    sel = select_backend(("paged_decode",), device=CPU, dtype=F32, registry=registry(on_prefill), features=MULTI)
    assert sel.names == {"paged_decode": "onpre"} and sel.multi_token_wrapper == "paged_prefill"
    # prefill asked alone: multi-token rows are not its to judge
    pre0 = spec("pre0", provides={"paged_prefill": PREFILL}, priority=3)
    sel = select_backend(("paged_prefill",), device=CPU, dtype=F32, registry=registry(pre0), features=MULTI)
    assert sel.names == {"paged_prefill": "pre0"} and sel.multi_token_wrapper is None
    # a decode pick named alone that cannot run them is refused, naming it
    with pytest.raises(BackendUnavailable, match=r"3 query tokens per decode row .*\(paged_decode: dec: "):
        select_backend(("paged_decode",), requested={"paged_decode": "dec"}, device=CPU, dtype=F32,
                       registry=registry(spec("dec")), features=MULTI)


# -- which contract each pick speaks -------------------------------------------------------------

def test_the_log_says_auto_picked_only_where_auto_picked(caplog):
    caplog.set_level(logging.INFO, logger="mstar.registry")
    reg = registry()
    select_backend(PAGED, device=CPU, dtype=F32, registry=reg)
    assert "auto picked attention backend 'reference'" in caplog.text
    caplog.clear()
    select_backend(PAGED, requested={"default": "reference"}, device=CPU, dtype=F32, registry=reg)
    assert "auto picked" not in caplog.text and "attention backends per capability" in caplog.text


def test_a_probe_reason_ending_in_words_that_are_not_capabilities_is_kept_as_written():
    # only a tail of capability names marks a reason to merge across capabilities
    why = ["library built without support in mixed, debug", "library built without support in bounded"]
    reg = registry(spec("odd", priority=5, probe=lambda device: why))
    sel = select_backend(("paged_decode",), device=CPU, dtype=F32, registry=reg)
    assert sel.name == "reference" and sel.rejected["odd"] == why


def test_selection_gives_each_capabilitys_spec_and_plugin_api_version():
    reg = registry(spec("olddec", api_version="1.0", priority=5))
    sel = select_backend(PAGED, device=CPU, dtype=F32, registry=reg)
    assert sel.names == {"paged_prefill": "reference", "paged_decode": "olddec", "mixed": "reference"}
    assert sel.spec_for("paged_decode") is sel.backend_for("paged_decode")
    assert sel.spec_for("paged_decode").name == "olddec" and sel.api_version("paged_decode") == "1.0"
    reference = sel.spec_for("paged_prefill")
    assert reference is not None and reference.name == "reference"  # the reference has a spec of its own
    assert sel.api_version("paged_prefill") == sel.api_version("mixed") == REFERENCE.api_version == "2.0"
    assert sel.spec_for("bounded") is None
    with pytest.raises(UnknownName, match="did not select 'bounded'; it selected paged_prefill, paged_decode, mixed"):
        sel.api_version("bounded")


def test_a_named_selection_gives_its_one_spec_for_every_capability():
    reg = registry(spec("olddec", api_version="1.0"))
    sel = select_backend(("paged_decode",), requested="olddec", device=CPU, dtype=F32, registry=reg)
    assert sel.spec_for("paged_decode") is sel.backend and sel.api_version("paged_decode") == "1.0"
    assert sel.spec_for("paged_prefill") is None


def test_the_old_method_names_still_answer_and_warn():
    s = spec("old", head_dims=HeadDims(values=(64,)))
    with pytest.warns(DeprecationWarning, match="HeadDims.reasons is renamed HeadDims.refusal"):
        assert s.head_dims.reasons(96) == [s.head_dims.refusal(96)]
    with pytest.warns(DeprecationWarning, match="BackendSpec.declared_reasons is renamed"):
        assert s.declared_reasons(("paged_decode",), F32, 96) == s.declared_refusals(("paged_decode",), F32, 96)
    with pytest.warns(DeprecationWarning, match="BackendSpec.feature_reasons is renamed"):
        assert s.feature_reasons(("paged_decode",), MULTI) == s.declared_refusals(("paged_decode",), features=MULTI)
