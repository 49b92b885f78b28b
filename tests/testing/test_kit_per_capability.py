"""The kit (``mstar check``) on plugin API 1.1 declarations: each capability checked at its own
dtypes and head dims, and multi-token decode rows checked on the wrapper declared to run them."""

from __future__ import annotations

import torch

from mstar_core import BackendSpec, CapabilitySpec, HeadDims, Registry
from mstar_core.testing import check as K

PREFILL = "mstar_core.backends.reference:ReferencePrefillWrapper"
DECODE = "mstar_core.backends.reference:ReferenceDecodeWrapper"
F32, F64 = torch.float32, torch.float64


def _registry(spec: BackendSpec) -> Registry:
    reg = Registry(discover=False)
    reg.register(spec, distribution="k-mstar", version="0.1")
    return reg


def test_each_capability_is_checked_at_its_own_dtypes_and_head_dims():
    spec = BackendSpec(name="k", provides={"paged_prefill": PREFILL, "paged_decode": DECODE}, devices=("cpu",),
                       dtypes=(F32, F64), head_dims=HeadDims(values=(64, 128)), api_version="1.1",
                       per_capability={"paged_decode": CapabilitySpec(dtypes=(F32,), head_dims=HeadDims(values=(64,)))})
    report = K.check_backend("k", device="cpu", registry=_registry(spec), quick=True)
    assert report.ok, report.render(all_rows=False)
    by_cap = {c: {r for r in report.results if r.capability == c} for c in ("paged_prefill", "paged_decode")}
    assert {r.dtype for r in by_cap["paged_decode"]} == {"float32"}
    assert {r.dtype for r in by_cap["paged_prefill"]} == {"float32", "float64"}
    # --quick checks the first head dim each capability declares: 64 for both here; the full run both
    full = [c for c in K.plan_checks(spec, {"paged_prefill": object, "paged_decode": object}, "cpu")
            if c.group == "replan" and c.dtype == F32]
    assert {c.name for c in full if c.capability == "paged_decode"} == {"decode-d64", "refused-decode-d64"}
    assert {c.name for c in full if c.capability == "paged_prefill"} >= {"prefill-d64", "prefill-d128"}


def test_multi_token_rows_are_checked_on_the_wrapper_declared_to_run_them():
    decode_only = BackendSpec(name="k", provides={"paged_decode": DECODE}, devices=("cpu",), dtypes=(F32,),
                              api_version="1.1", features={"paged_decode": ("multi_token_decode",)})
    report = K.check_backend("k", device="cpu", registry=_registry(decode_only), quick=True)
    assert report.ok, report.render(all_rows=False)
    multi = [r for r in report.results if r.name.startswith("multi_token-")]
    assert multi and {r.capability for r in multi} == {"paged_decode"}
    assert "multi_token_decode" not in report.not_covered
    # written for 1.0, the same declaration meant rows on a prefill wrapper it does not provide
    old = BackendSpec(name="k", provides={"paged_decode": DECODE}, devices=("cpu",), dtypes=(F32,),
                      features={"paged_decode": ("multi_token_decode",)})
    report = K.check_backend("k", device="cpu", registry=_registry(old), quick=True)
    assert not any(r.name.startswith("multi_token-") for r in report.results)
    assert "plugin API 1.0 spec" in report.not_covered["multi_token_decode"]


def test_a_given_dtype_only_another_capability_declares_is_not_checked_on_this_one():
    spec = BackendSpec(name="k", provides={"paged_prefill": PREFILL, "paged_decode": DECODE}, devices=("cpu",),
                       dtypes=(F32, F64), api_version="1.1",
                       per_capability={"paged_decode": CapabilitySpec(dtypes=(F32,))})
    classes = {"paged_prefill": object, "paged_decode": object}
    checks = K.plan_checks(spec, classes, "cpu", dtypes=[F64], quick=True)
    assert checks and {(c.capability, c.dtype) for c in checks} == {("paged_prefill", F64)}
    report = K.check_backend("k", device="cpu", dtypes=[F64], registry=_registry(spec), quick=True)
    assert report.ok, report.render(all_rows=False)
    assert report.results and {r.capability for r in report.results} == {"paged_prefill"}
    # a dtype no capability declares is checked as given on every one (a stand-in on a CPU)
    half = BackendSpec(name="h", provides={"paged_prefill": PREFILL, "paged_decode": DECODE}, devices=("cpu",),
                       dtypes=(torch.float16,), api_version="1.1")
    assert {c.capability for c in K.plan_checks(half, classes, "cpu", dtypes=[F32], quick=True)} == set(classes)
