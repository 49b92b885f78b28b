"""BackendSpec: a declaration checked when it is made (a bad field raises naming it), kept as
plain copies a plugin cannot change afterwards, and read back by its lookups."""

from __future__ import annotations

import pytest
import torch

from mstar_core.backends.reference import ReferenceDecodeWrapper
from mstar_core.errors import InputError, InputTypeError, UnknownName
from mstar_core.registry.spec import BackendSpec, CapabilitySpec, HeadDims

PREFILL = "mstar_core.backends.reference:ReferencePrefillWrapper"
DECODE = "mstar_core.backends.reference:ReferenceDecodeWrapper"
RAGGED = "mstar_core.backends.reference:ReferencePrefixedPrefillWrapper"
F32 = torch.float32


def spec(provides=None, **kw) -> BackendSpec:
    kw.setdefault("api_version", "1.1")
    return BackendSpec(name=kw.pop("name", "mine"), provides=provides or {"paged_decode": DECODE},
                       dtypes=(F32,), **kw)


# -- checked when made ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", "two words", "dotted.name", 3, None])
def test_a_name_that_is_not_an_identifier_is_refused(name):
    with pytest.raises(InputError, match=r"backend name must be a non-empty identifier, got " + repr(name)):
        spec(name=name)


def test_a_name_may_hold_dashes_and_underscores():
    assert spec(name="my-fast_kernel2").name == "my-fast_kernel2"


@pytest.mark.parametrize("field,value,match", [
    ("kv_layout", 3, "kv_layout must be a layout name such as 'nhd'"),
    ("kv_layout", "", "kv_layout must be a layout name such as 'nhd'"),
    ("measured", 3, "measured must be 'module:attr' of a function"),
    ("measured", ("pkg", ":"), "measured must be 'module:attr' of a function"),
    ("measured", "pkg.times", "measured must be 'module:attr' of a function"),
    ("excludes", [("soft_cap", "sink_logits")], "excludes must map capability names to tuples of feature .* got list"),
    ("per_capability", ["paged_decode"], "per_capability must map capability names to CapabilitySpec, got list"),
], ids=["kv_layout-int", "kv_layout-empty", "measured-int", "measured-tuple", "measured-no-colon", "excludes-list",
        "per_capability-list"])
def test_an_api_1_1_field_of_the_wrong_type_is_named(field, value, match):
    with pytest.raises(InputTypeError, match=match):
        spec(**{field: value})


@pytest.mark.parametrize("ref", [3, ("pkg", ":"), "pkg.Wrapper"])
def test_a_wrapper_reference_that_is_not_module_attr_is_refused(ref):
    with pytest.raises(InputError, match=r"provides\['paged_decode'\] must be 'module:attr', got "):
        spec(provides={"paged_decode": ref})


def test_capturable_names_only_capabilities_it_provides():
    with pytest.raises(InputError, match=r"capturable names capabilities it does not provide: \['paged_prefill'\]"):
        spec(capturable=("paged_decode", "paged_prefill"))
    assert spec(capturable=("paged_decode",)).capturable == ("paged_decode",)


def test_priority_defaults_to_zero_for_every_capability():
    mine = spec()
    assert mine.priority == 0
    assert mine.priority_for("paged_decode") == 0


# -- kept as plain copies ------------------------------------------------------------------------

def test_the_callers_dicts_changed_afterwards_do_not_change_the_spec():
    provides = {"paged_decode": DECODE}
    features = {"paged_decode": ["soft_cap", "sink_logits"]}
    excludes = {"paged_decode": [["soft_cap", "sink_logits"]]}
    per_capability = {"paged_decode": CapabilitySpec(dtypes=(F32,))}
    mine = spec(provides=provides, features=features, excludes=excludes, per_capability=per_capability)
    provides["paged_prefill"] = PREFILL
    features["paged_decode"].append("fp8_e4m3")
    features["paged_prefill"] = ["soft_cap"]
    excludes["paged_decode"][0].append("fp8_e4m3")
    excludes["paged_prefill"] = []
    per_capability["paged_prefill"] = CapabilitySpec()
    assert mine.provides == {"paged_decode": DECODE}
    assert mine.features == {"paged_decode": ("soft_cap", "sink_logits")}
    assert mine.excludes == {"paged_decode": (("soft_cap", "sink_logits"),)}
    assert mine.per_capability == {"paged_decode": CapabilitySpec(dtypes=(F32,))}
    assert mine.supports("paged_decode") == ("soft_cap", "sink_logits")


# -- read back -----------------------------------------------------------------------------------

def test_load_imports_a_provided_wrapper_and_names_one_it_does_not_provide():
    mine = spec()
    assert mine.load("paged_decode") is ReferenceDecodeWrapper
    missing = r"backend 'mine' does not provide 'paged_prefill'; it provides \['paged_decode'\]"
    with pytest.raises(UnknownName, match=missing):
        mine.load("paged_prefill")


def test_a_capability_declaring_only_dtypes_keeps_the_backends_head_dims():
    dims = HeadDims(values=(64, 128))
    mine = spec(head_dims=dims, per_capability={"paged_decode": CapabilitySpec(dtypes=(torch.float16,))})
    assert mine.head_dims_for("paged_decode") == dims
    assert mine.declared_refusals(("paged_decode",), dtype=torch.float16, head_dim=64) == []
    assert mine.declared_refusals(("paged_decode",), dtype=torch.float16, head_dim=96) == [
        "head_dim 96 is not supported in paged_decode (supported: 64, 128)"]


def test_a_1_0_spec_runs_multi_token_rows_on_prefill_only_where_decode_declares_them():
    both = {"paged_decode": DECODE, "paged_prefill": PREFILL}
    assert spec(provides=both, api_version="1.0").multi_token_wrappers() == ()
    declared = spec(provides=both, api_version="1.0", features={"paged_decode": ("multi_token_decode",)})
    assert declared.multi_token_wrappers() == ("paged_prefill",)


def test_with_no_capability_asked_the_backends_own_dtypes_and_head_dims_are_judged():
    mine = spec(head_dims=HeadDims(multiple_of=64))
    assert mine.declared_refusals() == []
    assert mine.declared_refusals(dtype=torch.float64, head_dim=96) == [
        "dtype float64 is not supported (supported: float32)",
        "head_dim 96 is not supported (supported: multiples of 64)"]


def test_another_kv_layout_refuses_only_a_request_with_a_paged_capability():
    mine = spec(provides={"paged_decode": DECODE, "prefixed_ragged": RAGGED}, kv_layout="hnd")
    layout = "reads KV layout 'hnd'; mstar's paged cache stores 'nhd'"
    assert mine.declared_refusals() == []
    assert mine.declared_refusals(("prefixed_ragged",)) == []
    for asked in [("paged_decode",), ("prefixed_ragged", "paged_decode"), ("paged_decode", "prefixed_ragged")]:
        (reason,) = mine.declared_refusals(asked)
        assert reason.startswith(layout)
