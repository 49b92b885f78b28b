"""The numerics cases of ``mstar check`` do what they say (scores in the hundreds, rows far below
zero, long rows), the per-row tolerance grows only as float32 summation does, the default run
checks every declared head dim and names what it leaves out, and ``--group`` selects groups."""

from __future__ import annotations

import math

import pytest
import torch

from mstar_core import BackendSpec, Registry
from mstar_core.backends import reference as R
from mstar_core.cli import main
from mstar_core.errors import InputError
from mstar_core.registry.spec import HeadDims
from mstar_core.testing import check as K
from mstar_core.testing import conformance as C
from mstar_core.testing import numerics as N
from mstar_core.testing.groups import GROUPS

F32, BF16 = torch.float32, torch.bfloat16
KINDS = ("prefill", "decode", "mixed", "ragged")


def _scores(case, dtype=F32) -> list[torch.Tensor]:
    """Each row's scores ``q . k * scale`` as the kernel would see them (stored dtype), per head."""
    scale = 1.0 / math.sqrt(case.head_dim) if case.sm_scale is None else case.sm_scale
    out = []
    if isinstance(case, C.RaggedCase):
        data = C.make_ragged(case, "cpu", dtype)
        q, k = data.q.double(), data.k.double()
        cu_q, cu_k = data.cu_q.tolist(), data.cu_k.tolist()
        rows = [(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]]) for i in range(len(case.q_lens))]
    else:
        data = C.make_paged(case, "cpu", dtype)
        q, qo = data.q.double(), data.qo_indptr.tolist()
        rows = [(q[qo[i]:qo[i + 1]], keys.double()) for i, (keys, _) in enumerate(data.keys)]
    for rq, rk in rows:
        rk = rk.repeat_interleave(case.gqa, dim=1)
        out.append(torch.einsum("qhd,khd->hqk", rq, rk) * scale)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_shaped_scores_reach_the_hundreds_and_stay_far_below_zero(kind):
    hundreds, below, plain_long, long_hundreds = C.numerics_cases(kind, 64)
    rows = _scores(hundreds)
    # every row of several stretches spans hundreds; the spread rows hold both signs
    assert max(float(s.max()) for s in rows) > 250 and min(float(s.min()) for s in rows) < -250
    assert any(float(s.max()) > 250 and float(s.min()) < -250 for s in rows)
    assert all(float(s.max()) < -100 for s in _scores(below))
    # the long unit-scale row's scores stay a few units; its keys reach LONG_KEYS
    assert max(abs(float(s.max())) for s in _scores(plain_long)) < 20
    assert max(plain_long.kv_lens) == C.LONG_KEYS == max(long_hundreds.kv_lens)
    assert long_hundreds.scores == "hundreds" and "-scores_hundreds" in str(long_hundreds)


@pytest.mark.parametrize(("pattern", "high_first"), [("fall", True), ("rise", False)])
def test_a_falling_or_rising_row_keeps_its_maximum_at_one_end(pattern, high_first):
    offsets = N.row_offsets(pattern, 32767, torch.Generator().manual_seed(0))
    half = offsets.shape[0] // 2
    high, low = (offsets[:half], offsets[half:]) if high_first else (offsets[half:], offsets[:half])
    # a merge against the low half's maximum is off by far more than exp's float32 range (88.7)
    assert float(high.max()) > 290 and float(low.max()) < -140


def test_quick_rows_are_shorter_and_every_case_is_drawn_again_the_same():
    for kind in KINDS:
        quick = C.numerics_cases(kind, 128, quick=True)
        assert max(max(c.kv_lens) for c in quick) == C.QUICK_LONG_KEYS < C.LONG_KEYS
        assert [str(c) for c in quick] == [str(c) for c in C.numerics_cases(kind, 128, quick=True)]
    case = C.numerics_cases("decode", 64)[0]
    a, b = C.make_paged(case, "cpu", F32), C.make_paged(case, "cpu", F32)
    assert torch.equal(a.q, b.q) and torch.equal(a.layer, b.layer)


def test_the_tolerance_grows_as_float32_summation_does():
    assert N.tolerance(1.6e-2, BF16, 1) == pytest.approx(1.6e-2 + 2.0 ** -24)
    assert N.tolerance(2e-5, F32, 32768) == pytest.approx(2e-5 + 32768 * 2.0 ** -24)
    assert N.tolerance(1e-9, torch.float64, 32768) < 1e-9 + 1e-11
    # a bf16 accumulator's step (2**-8) at a single add is past float32's growth over 32k keys
    assert N.tolerance(1.6e-2, BF16, 32768, N.REACH, 256) - 1.6e-2 < 2.0 ** -8
    case = C.numerics_cases("decode", 64)[2]
    tols = C.row_tolerances(case, F32)
    assert tols[0] > tols[1] > tols[2] >= C.TOLERANCE[F32]


def test_row_errors_name_the_worst_row():
    case = C.PagedCase(16, 64, 1, (1, 1), (5, 9))
    ref = torch.ones((2, 1, 64), dtype=torch.float64)
    out = ref.clone()
    out[1] *= 1.5
    errs = C.row_errors(case, out, ref, torch.ones(2, dtype=torch.bool))
    assert errs == [0.0, pytest.approx(0.5)]


def _spec(**kw) -> BackendSpec:
    kw.setdefault("dtypes", (F32,))
    return BackendSpec(name="dims", provides={"paged_decode": "mstar_core.backends.reference:ReferenceDecodeWrapper"},
                       devices=("cpu",), **kw)


@pytest.mark.parametrize(("dims", "want"), [
    (HeadDims(), (64, 128, 256)),
    (HeadDims(multiple_of=8, maximum=256), (64, 128, 256)),
    (HeadDims(multiple_of=64, maximum=512), (64, 128, 256, 512)),
    (HeadDims(multiple_of=32, maximum=96), (64, 96)),
    (HeadDims(values=(80, 64, 256)), (64, 80, 256)),
])
def test_the_default_run_checks_every_declared_head_dim(dims, want):
    assert K.default_head_dims(_spec(head_dims=dims)) == want


def test_what_a_run_leaves_out_is_named():
    classes = {"paged_decode": R.ReferenceDecodeWrapper}
    listed = _spec(head_dims=HeadDims(values=(64, 96, 128)), dtypes=(F32, BF16))
    assert K.left_out(listed, classes, None, None, False) == {}
    quick = K.left_out(listed, classes, None, None, True)
    assert quick == {"paged_decode head dims": "96, 128 declared, not checked: --quick checks the first head dim only"}
    asked = K.left_out(listed, classes, [F32], [96], False)
    assert asked == {"paged_decode head dims": "64, 128 declared, not checked: not asked (--head-dim)",
                     "paged_decode dtypes": "bfloat16: not asked (--dtype)"}
    ranged = K.left_out(_spec(head_dims=HeadDims(multiple_of=32, maximum=96)), classes, None, None, False)
    assert ranged == {"paged_decode head dims": "declares multiples of 32 up to 96; checked 64, 96 only "
                                                "(64, 128, 256 and the largest declared)"}


@pytest.fixture
def registry() -> Registry:
    reg = Registry(discover=False)
    reg.register(_spec(head_dims=HeadDims(values=(64,))))
    return reg


def test_groups_select_cases_and_the_rest_are_named(registry):
    report = K.check_backend("dims", "cpu", registry=registry, quick=True, groups=["numerics", "edge"])
    assert report.ok, report.render(all_rows=False)
    assert {r.group for r in report.results} == {"numerics", "edge"}
    # no feature is declared: no feature case to leave out
    assert report.not_covered["groups"] == "layers, plain, replan, shapes not run (--group numerics edge)"
    # the zero-key decode rows are among the edge cases, and the reference gives them zeros
    assert any(r.group == "edge" and "-p-1_20_-1" in r.name and not r.refused for r in report.results)
    with pytest.raises(InputError, match="unknown group 'numeric'; the groups are " + ", ".join(GROUPS)):
        K.check_backend("dims", "cpu", registry=registry, groups=["numeric"])


def test_the_cli_takes_groups_but_not_for_layer_groups(registry, monkeypatch, capsys):
    monkeypatch.setattr("mstar_core.registry.registry._default", registry)
    assert main(["check", "dims", "--quick", "--group", "numerics"]) == 0
    out = capsys.readouterr().out
    assert "4 of 4 cases passed" in out and "groups: edge, layers, plain, replan, shapes not run" in out
    assert main(["check", "auto", "--group", "numerics"]) == 2
    assert "--group selects cases of one named backend" in capsys.readouterr().err


def _stretches(offsets: torch.Tensor) -> list[float]:
    """Each stretch's offset, its per-key noise averaged out (to within about a unit)."""
    return [float(s.mean()) for s in offsets.split(N.STRETCH)]


# pattern -> its first and last stretch, as the docs give them (REACH = 300)
ENDS = {"fall": (300, -300), "rise": (-300, 300), "spread": (300, -300), "high": (300, 150), "low": (-150, -300)}


@pytest.mark.parametrize("pattern", sorted(N.PATTERNS))
def test_a_row_s_stretches_keep_to_its_pattern_s_ranges(pattern):
    assert (N.HIGH, N.LOW, N.ANY) == ((150, 300), (-300, -150), (-300, 300))
    n = 64
    per = _stretches(N.row_offsets(pattern, n * N.STRETCH, torch.Generator().manual_seed(1)))
    # the high end holds 3/8 of the stretches (24 of 64), at the start of a row but a rising one
    top = 24 if pattern != "rise" else n - 24
    for (lo, hi), part in zip(N.PATTERNS[pattern], (per[1:top], per[top:-1]), strict=True):
        assert all(lo - 1 < p < hi + 1 for p in part), (lo, hi, part)
        # the offsets are drawn over the whole range, not from one end of it
        assert min(part) < lo + (hi - lo) / 4 and max(part) > hi - (hi - lo) / 4, (lo, hi, part)
    assert per[0] == pytest.approx(ENDS[pattern][0], abs=1) and per[-1] == pytest.approx(ENDS[pattern][1], abs=1)


@pytest.mark.parametrize("pattern", sorted(N.PATTERNS))
def test_a_row_of_two_stretches_holds_both_ends(pattern):
    per = _stretches(N.row_offsets(pattern, 2 * N.STRETCH, torch.Generator().manual_seed(2)))
    assert per == pytest.approx(ENDS[pattern], abs=1)


def test_the_tolerance_adds_each_term_only_where_asked():
    assert N.tolerance(0.0, torch.float64, 1024) == 1024 * 2.0 ** -53
    assert N.tolerance(0.0, F32, 10, head_dim=64) == 10 * 2.0 ** -24  # no reach: the scores add nothing
    assert N.tolerance(0.0, F32, 10, reach=300.0) == 10 * 2.0 ** -24  # no head dim: likewise
    assert N.tolerance(0.0, F32, 10, 300.0, 64) == (10 + 2400) * 2.0 ** -24


def test_the_shaped_queries_and_keys_lie_along_a_unit_direction_per_kv_head():
    gen = torch.Generator().manual_seed(3)
    q = torch.zeros((5, 8, 64))
    adds = N.shape_scores("hundreds", q, [300, 7], 4, 0.5, gen)
    # a query is its KV head's unit direction (plus a little noise) over the scale
    assert torch.all(((q * 0.5).norm(dim=-1) - 1).abs() < 0.5)
    for add, n in zip(adds, (300, 7), strict=True):
        assert add.shape == (n, 2, 64)
        norms = add.norm(dim=-1)  # |offset_j| on every KV head alike
        assert torch.allclose(norms[:, 0], norms[:, 1], rtol=1e-5) and float(norms.max()) < 320
