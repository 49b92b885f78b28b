"""``mstar check`` and the suite behind it: the reference passes it; each kind of planted bug
(a backend author's real mistakes) is caught and named; the CLI's table, JSON and exit codes;
the pytest entry."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from mstar_core import BackendSpec, HeadDims, MstarError, Registry, reset_registry
from mstar_core.backends import reference as R
from mstar_core.cli import main
from mstar_core.testing import check as K
from mstar_core.testing import conformance as C

F32, BF16 = torch.float32, torch.bfloat16


# -- planted bugs: each a subclass of a correct wrapper with one mistake ---------------------------

class RaggedIgnoresScale(R.ReferencePrefixedPrefillWrapper):
    def plan(self, *a, sm_scale=None, **kw):
        super().plan(*a, **kw)


class DecodeIgnoresScale(R.ReferenceDecodeWrapper):
    def plan(self, *a, sm_scale=None, **kw):
        super().plan(*a, **kw)


class RaggedFloat32Out(R.ReferencePrefixedPrefillWrapper):
    def run(self, q, k, v, **kw):
        return super().run(q, k, v, **kw).float()


class DecodeKeepsFirstPlan(R.ReferenceDecodeWrapper):
    def plan(self, *a, **kw):
        if not getattr(self, "_planned_once", False):
            self._planned_once = True
            super().plan(*a, **kw)


class RaggedIgnoresWindow(R.ReferencePrefixedPrefillWrapper):
    def plan(self, *a, window_left=-1, **kw):
        super().plan(*a, **kw)


class RaggedLeaksAcrossRows(R.ReferencePrefixedPrefillWrapper):
    def run(self, q, k, v, **kw):
        out = super().run(q, k, v, **kw)
        return out + 0.0 * out.sum()  # a batch-wide reduction: one row's NaN reaches every row


class RaggedNaNForNoKey(R.ReferencePrefixedPrefillWrapper):
    def plan(self, cu_q, cu_k, *a, **kw):
        super().plan(cu_q, cu_k, *a, **kw)
        self._short = [(int(cu_q[i]), int(cu_q[i]) + max(0, int(cu_q[i + 1] - cu_q[i]) - int(cu_k[i + 1] - cu_k[i])))
                       for i in range(len(cu_q) - 1)]

    def run(self, q, k, v, **kw):
        out = super().run(q, k, v, **kw)
        for a, b in self._short:  # an unguarded softmax: 0 / 0 where a query sees no key
            out[a:b] = float("nan")
        return out


class RaggedWrongShape(R.ReferencePrefixedPrefillWrapper):
    def run(self, q, k, v, **kw):
        return super().run(q, k, v, **kw).flatten(1)


PLANTED = {
    # name -> (capability, wrapper, dtypes, (group, substring of the case name) that must fail, their rules)
    "ragged_scale": ("prefixed_ragged", RaggedIgnoresScale, (F32,), ("plain", "scale0.07"), "oracle"),
    "decode_scale": ("paged_decode", DecodeIgnoresScale, (F32,), ("plain", "scale0.07"), "oracle"),
    "f32_out": ("prefixed_ragged", RaggedFloat32Out, (BF16,), ("plain", ""), "dtype"),
    # the plans after the first ignored: the steps re-planned, and a plan it must refuse
    "first_plan": ("paged_decode", DecodeKeepsFirstPlan, (F32,), ("replan", "decode"), "replan unknown-keyword"),
    "dense_window": ("prefixed_ragged", RaggedIgnoresWindow, (F32,), ("plain", "win5"), "oracle"),
    "row_leak": ("prefixed_ragged", RaggedLeaksAcrossRows, (F32,), ("edge", "poison1"), "isolation"),
    "no_key": ("prefixed_ragged", RaggedNaNForNoKey, (F32,), ("edge", "p-3"), "no-key"),
    "shape": ("prefixed_ragged", RaggedWrongShape, (F32,), ("plain", ""), "shape"),
}


@pytest.fixture
def planted(monkeypatch):
    """A registry holding one backend per planted bug, plus ``honest`` (the reference's own)."""
    mod = types.ModuleType("mstar_planted_bugs")
    for name, (_, cls, _, _, _) in PLANTED.items():
        setattr(mod, name, cls)
    mod.honest_ragged, mod.honest_decode = R.ReferencePrefixedPrefillWrapper, R.ReferenceDecodeWrapper
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    reg = Registry(discover=False)
    for name, (cap, _, dtypes, _, _) in PLANTED.items():
        reg.register(BackendSpec(name=name, provides={cap: f"{mod.__name__}:{name}"}, devices=("cpu",), dtypes=dtypes))
    reg.register(BackendSpec(name="honest", devices=("cpu",), dtypes=(F32, BF16), provides={
        "prefixed_ragged": f"{mod.__name__}:honest_ragged", "paged_decode": f"{mod.__name__}:honest_decode"}))
    return reg


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_bug_is_caught_and_named(planted, bug):
    cap, _, _, (group, needle), rule = PLANTED[bug]
    report = K.check_backend(bug, device="cpu", registry=planted)
    assert not report.ok
    hits = [r for r in report.failed if r.capability == cap and r.group == group and needle in r.name]
    assert hits, f"{bug}: expected a failing {group} case containing {needle!r}; failed: " \
                 f"{[(r.group, r.name) for r in report.failed]}"
    assert all(r.message for r in report.failed)
    assert {r.rule for r in hits} == set(rule.split()), [(r.name, r.rule) for r in hits]


def test_the_failures_say_what_is_wrong(planted):
    f32 = K.check_backend("f32_out", device="cpu", registry=planted).failed[0].message
    assert "output dtype torch.float32, expected torch.bfloat16" in f32
    shape = K.check_backend("shape", device="cpu", registry=planted).failed[0].message
    assert "output shape" in shape and "[tokens, Hq, D]" in shape


def test_an_honest_backend_passes_every_case(planted):
    report = K.check_backend("honest", device="cpu", registry=planted)
    assert report.ok, report.render(all_rows=False)
    groups = {(r.capability, r.group) for r in report.results}
    for cap in ("prefixed_ragged", "paged_decode"):
        assert {(cap, g) for g in ("plain", "edge", "replan")} <= groups
    assert {r.dtype for r in report.results} == {"float32", "bfloat16"}


def test_every_window_case_of_the_new_families_bites():
    """A window that removes no key tests nothing: each family holds one that bites every row."""
    for cases in (C.prefill_cases(), C.decode_cases(), C.mixed_cases(), C.ragged_cases()):
        assert any(C.window_bites(c) for c in cases)
        assert any(c.sm_scale is not None for c in cases)


def test_the_reference_passes_the_whole_suite():
    reset_registry()
    report = K.check_backend("reference", device="cpu", dtypes=[F32])
    assert report.ok, report.render(all_rows=False)
    assert len(report.results) > 200
    # it declares any head dim and four dtypes: the summary names what this run leaves out
    caps = ("paged_prefill", "paged_decode", "mixed", "prefixed_ragged")
    assert report.not_covered == {"bounded": K.NOT_COVERED["bounded"],
                                  **{f"{cap} head dims": "declares any; checked 64, 128, 256 only (64, 128, 256 and "
                                     "the largest declared)" for cap in caps},
                                  **{f"{cap} dtypes": "float64: not asked (--dtype); float16: not asked (--dtype); "
                                     "bfloat16: not asked (--dtype)" for cap in caps}}
    # the feature, edge, shape, numerics and re-plan groups at every head dim checked, not only the largest
    dims = ("-d64", "-d128", "-d256")
    for group in ("features", "edge", "shapes", "numerics", "replan", "layers"):
        assert set(dims) == {d for r in report.results if r.group == group for d in dims if d in r.name}, group
    assert report.notes and "--device cuda" in report.notes[0]


def test_cli_table_json_and_exit_codes(planted, monkeypatch, capsys):
    monkeypatch.setattr("mstar_core.registry.registry._default", planted)
    assert main(["check", "honest", "--dtype", "float32", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "mstar check honest" in out and "of" in out and "cases passed" in out and "FAIL" not in out
    assert main(["check", "first_plan", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["failed"] == 6
    bad = [r for r in data["results"] if not r["passed"]]
    # re-planned steps computed with the first plan, and an unknown keyword accepted, at each head dim (64, 128, 256)
    assert {(r["group"], r["capability"], r["rule"]) for r in bad} == {
        ("replan", "paged_decode", "replan"), ("replan", "paged_decode", "unknown-keyword")}
    assert main(["check", "nope"]) == 2
    assert "'nope' (from argument) is unknown" in capsys.readouterr().err


def test_a_run_that_checks_nothing_does_not_pass(planted, monkeypatch, capsys):
    """No case run is no evidence: on a CPU the replay group holds no case, and the run fails."""
    report = K.check_backend("honest", device="cpu", registry=planted, groups=["replay"])
    assert report.results == [] and not report.ok and report.as_json()["ok"] is False
    monkeypatch.setattr("mstar_core.registry.registry._default", planted)
    assert main(["check", "honest", "--group", "replay"]) == 1
    assert "0 of 0 cases passed" in capsys.readouterr().out


def test_pytest_entry_gives_one_test_per_case(planted, monkeypatch):
    monkeypatch.setattr("mstar_core.registry.registry._default", planted)
    test = K.conformance_test("honest", dtypes=[F32], head_dims=[64])
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    checks = mark.args[1]
    assert len(checks) == len(set(c.id for c in checks)) > 20
    for c in checks[:3]:
        test(c)
    bug = K.conformance_test("first_plan", quick=True)
    (replan,) = [c for c in bug.pytestmark[0].args[1] if c.group == "replan" and not c.name.startswith("refused")]
    with pytest.raises((AssertionError, MstarError)):  # a wrong result, or a refused call
        bug(replan)
    from mstar_core import BackendUnavailable
    with pytest.raises(BackendUnavailable):
        K.conformance_test("nope")
    skipped = K.conformance_test("nope", skip_unavailable=True)
    assert skipped.pytestmark[0].name == "skip" and "unknown" in skipped.pytestmark[0].kwargs["reason"]


def test_check_refuses_dtypes_and_head_dims_the_backend_does_not_declare(planted, monkeypatch, capsys):
    monkeypatch.setattr("mstar_core.registry.registry._default", planted)
    with pytest.raises(ValueError, match=r"cannot check dtype float16; it declares float32"):
        K.check_backend("ragged_scale", dtypes=[torch.float16])
    planted.register(BackendSpec(name="narrow", devices=("cpu",), dtypes=(F32,), head_dims=HeadDims(values=(72,)),
                                 provides={"prefixed_ragged": "mstar_planted_bugs:honest_ragged"}))
    assert K.default_head_dims(planted.get("narrow")) == (72,)
    with pytest.raises(ValueError, match=r"cannot check head_dim 64 is not supported \(supported: 72\)"):
        K.check_backend("narrow", head_dims=[64])
    assert K.check_backend("narrow").ok
    planted.register(BackendSpec(name="only_bounded", devices=("cpu",), dtypes=(F32,),
                                 provides={"bounded": "mstar_core.kernels.bounded_attention:bounded_attention"}))
    assert main(["check", "only_bounded"]) == 2
    assert "provides only bounded, which mstar check does not cover" in capsys.readouterr().err
