"""Auto's order from the measured kernel times backends commit (BackendSpec.measured): among the
backends that can serve a capability, the measured ones on this GPU architecture go first,
fastest first, compared over the workloads both measured; everything else keeps its place."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest
import torch

from mstar_core import AttentionFeatures, select_backend
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.capabilities import PAGED
from mstar_core.errors import InputError, InputTypeError
from mstar_core.registry import BackendSpec, Registry
from mstar_core.registry.measured import MeasuredTable, load_table, measured_order

BF16 = torch.bfloat16


def table(name, arch="sm90", **ms):
    return MeasuredTable.from_dict({"backend": name, "arch": arch, "device": "NVIDIA H200", "source": "bench.json",
                                    "median_ms": ms}, name)


@pytest.fixture
def tables(monkeypatch):
    """``put(name, MeasuredTable)``: what ``tests_measured_tables:<name>`` returns."""
    mod = types.ModuleType("tests_measured_tables")
    monkeypatch.setitem(sys.modules, "tests_measured_tables", mod)

    def put(name, t):
        setattr(mod, name, lambda: t)
        return f"tests_measured_tables:{name}"
    return put


def gpu_backend(name, measured=None, **kw):
    """A CUDA backend serving the paged capabilities through the reference's wrappers."""
    return BackendSpec(name=name, provides={c: REFERENCE.provides[c] for c in PAGED}, devices=("cuda",),
                       measured=measured, api_version="1.1", **kw)


def pick(reg, **kw):
    return select_backend(capabilities=PAGED, requested="auto", device="cuda", dtype=BF16, head_dim=128, registry=reg,
                          honor_env=False, **kw)


def test_the_faster_backend_per_capability_is_picked_and_the_log_says_why(fake_gpu, tables, caplog):
    fake_gpu("sm90")
    reg = Registry(discover=False)
    reg.register(REFERENCE)
    reg.register(gpu_backend("slowdec", tables("slowdec", table(
        "slowdec", paged_decode={"decode 64x8192": 0.60, "decode 256x2048": 0.50},
        paged_prefill={"prefill 8x4096": 2.0}, mixed={"mixed": 1.0})), priority=5))
    reg.register(gpu_backend("fastdec", tables("fastdec", table(
        "fastdec", paged_decode={"decode 64x8192": 0.50, "decode 256x2048": 0.45},
        paged_prefill={"prefill 8x4096": 2.5}, mixed={"mixed": 1.1}))))
    with caplog.at_level(logging.INFO, logger="mstar.registry"):
        sel = pick(reg)
    assert sel.names == {"paged_prefill": "slowdec", "paged_decode": "fastdec", "mixed": "slowdec"}
    assert sel.measured["paged_decode"].startswith("paged_decode: measured on NVIDIA H200 (decode 256x2048, "
                                                   "decode 64x8192): fastdec 0.474 ms, slowdec 0.548 ms -> fastdec")
    assert "[bench.json]" in sel.measured["paged_decode"]
    assert "auto order by measured kernel times: paged_prefill" in caplog.text


def test_no_tables_or_one_table_leave_the_order_as_it_was(fake_gpu, tables):
    fake_gpu("sm90")
    reg = Registry(discover=False)
    reg.register(REFERENCE)
    reg.register(gpu_backend("first", priority=5))
    reg.register(gpu_backend("second", tables("second", table("second", paged_decode={"d": 0.1}))))
    sel = pick(reg)
    assert sel.name == "first" and sel.measured == {}


def test_a_table_of_another_architecture_does_not_count(fake_gpu, tables):
    fake_gpu("sm80")
    reg = Registry(discover=False)
    reg.register(REFERENCE)
    reg.register(gpu_backend("a", tables("a", table("a", paged_decode={"d": 0.9})), priority=5))
    reg.register(gpu_backend("b", tables("b", table("b", paged_decode={"d": 0.1}))))
    assert pick(reg).name == "a"


def test_only_shared_workloads_are_compared():
    a = table("a", paged_decode={"x": 1.0, "only_a": 0.01})
    b = table("b", paged_decode={"x": 0.5})
    order, why = measured_order(["a", "b", "reference"], {"a": a, "b": b}, "paged_decode", "sm90")
    assert order == ["b", "a", "reference"]
    assert "(x)" in why
    # nothing shared, or another capability: the order stands
    c = table("c", paged_decode={"y": 0.1})
    assert measured_order(["a", "c"], {"a": a, "c": c}, "paged_decode", "sm90") == (["a", "c"], None)
    assert measured_order(["a", "b"], {"a": a, "b": b}, "mixed", "sm90") == (["a", "b"], None)


def test_a_backend_that_cannot_run_is_skipped_whatever_its_figures(fake_gpu, tables):
    fake_gpu("sm90")
    reg = Registry(discover=False)
    reg.register(REFERENCE)
    reg.register(gpu_backend("fast", tables("fast", table("fast", paged_decode={"d": 0.1})), dtypes=(torch.float16,)))
    reg.register(gpu_backend("slow", tables("slow", table("slow", paged_decode={"d": 0.9}))))
    sel = pick(reg)
    assert sel.name == "slow"
    assert "dtype bfloat16 is not supported" in sel.rejected["fast"][0]


def test_an_unreadable_table_is_ignored_with_a_warning(fake_gpu, tables, caplog):
    fake_gpu("sm90")
    reg = Registry(discover=False)
    reg.register(REFERENCE)
    reg.register(gpu_backend("broken", "tests_measured_tables:missing", priority=5))
    reg.register(gpu_backend("ok", tables("ok", table("ok", paged_decode={"d": 0.1}))))
    with caplog.at_level(logging.WARNING, logger="mstar.registry"):
        assert pick(reg).name == "broken"  # its place in the order stands
    assert "its measured table tests_measured_tables:missing cannot be read" in caplog.text


@pytest.mark.parametrize("doc,match", [
    ([], "must be a JSON object"),
    ({"backend": "x", "arch": "sm90"}, "needs 'median_ms'"),
    ({"backend": "x", "arch": "sm90", "median_ms": {"paged_decode": 1.0}}, "capability -> workload"),
    ({"backend": "x", "arch": "sm90", "median_ms": {"paged_decode": {"d": -1}}}, "positive number"),
    ({"backend": "x", "arch": "sm90", "median_ms": [{"d": 1.0}]}, "capability -> workload"),
    ({"backend": "x", "arch": "sm90", "median_ms": {"paged_decode": {"d": 1.0}, "mixed": 2}}, "capability -> workload"),
    ({"backend": "x", "arch": "sm90", "median_ms": {"paged_decode": {"d": 0}}}, "positive number"),
    ({"backend": "x", "arch": "sm90", "median_ms": {"paged_decode": {"d": "1.0"}}}, "positive number"),
    ({"backend": "x", "arch": "sm90", "median_ms": {"paged_decode": {"d": True}}}, "positive number"),
    ({"backend": "x", "arch": "sm90", "median_ms": {"paged_decode": {"d": float("inf")}}}, "positive number"),
])
def test_bad_tables_are_refused_naming_what_is_wrong(doc, match):
    with pytest.raises((InputError, InputTypeError), match=match):
        MeasuredTable.from_dict(doc, "t.json")


def test_keys_beyond_the_known_ones_are_kept_as_extra():
    t = MeasuredTable.from_dict({"backend": "x", "arch": "sm90", "median_ms": {}, "device": "H200", "source": "s",
                                 "torch": "2.5"}, "t.json")
    assert (t.device, t.source, t.extra) == ("H200", "s", {"torch": "2.5"})


def test_measured_needs_api_1_1_and_a_reference():
    with pytest.raises(InputError, match="measured came with plugin API 1.1"):
        BackendSpec(name="x", provides={}, measured="m:f")
    with pytest.raises(InputTypeError, match="measured must be 'module:attr'"):
        BackendSpec(name="x", provides={}, measured="nocolon", api_version="1.1")


@pytest.mark.parametrize("package", ["mstar_fa3", "mstar_flashinfer"])
def test_the_first_party_tables_load_and_name_their_backend(package):
    import importlib.resources

    if not importlib.resources.files(package).joinpath("measured.json").is_file():
        pytest.skip(f"{package} ships no measured table")
    t = load_table(package, "measured.json")
    assert t.backend == package.removeprefix("mstar_")
    assert t.arch == "sm90" and t.source.startswith("results/")
    assert set(t.median_ms) == set(PAGED)
    assert json.loads(importlib.resources.files(package).joinpath("measured.json").read_text())["backend"] == t.backend


def test_mstar_backends_says_where_measured_times_ordered_the_picks(fake_gpu, tables, monkeypatch):
    from mstar_core.cli.backends import collect, render

    fake_gpu("sm90")
    reg = Registry(discover=False)
    reg.register(REFERENCE)
    reg.register(gpu_backend("slow", tables("slow", table("slow", paged_decode={"d": 0.9})), priority=5))
    reg.register(gpu_backend("fast", tables("fast", table("fast", paged_decode={"d": 0.1}))))
    data = collect(reg, torch.device("cuda"), BF16, 128, AttentionFeatures())
    assert data["auto"]["paged_decode"]["pick"] == "fast"
    assert data["auto"]["paged_decode"]["measured"].startswith("paged_decode: measured on NVIDIA H200 (d): fast 0.1 ms")
    assert data["auto"]["paged_prefill"]["measured"] is None
    assert "ordered by measured kernel times: paged_decode: measured on NVIDIA H200" in render(data)
