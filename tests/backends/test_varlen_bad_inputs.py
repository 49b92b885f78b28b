"""The FA3 / AITER prefixed ragged wrappers (their shared base, ``VarlenPrefixedWrapper``) refuse
bad ``cu`` arrays, bounds, mask parameters and devices with errors naming the bad value, before
anything changes: a refused plan keeps the previous one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

BF16 = torch.bfloat16


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture(params=["fa3", "aiter"])
def wrapper(request, fa3_standin, aiter_standin):
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper
    from mstar_rocm.ragged import AiterPrefixedPrefillWrapper

    cls = FA3PrefixedPrefillWrapper if request.param == "fa3" else AiterPrefixedPrefillWrapper
    return cls(4, 2, 64, "cpu")


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 64, generator=gen).to(BF16)  # segments of 2 and 3 queries
    k = torch.randn(9, 2, 64, generator=gen).to(BF16)  # over 4 and 5 keys
    v = torch.randn(9, 2, 64, generator=gen).to(BF16)
    return q, k, v


GOOD = (t([0, 2, 5]), t([0, 4, 9]), 3, 5)

BAD = {
    "cu_q-empty": ((t([]), t([0, 9]), 3, 9), {}, ValueError,
                   r"cu_q must be 1-D with at least one entry .*got shape \(0,\)"),
    "both-empty": ((t([]), t([]), 0, 0), {}, ValueError, r"cu_q must be 1-D with at least one entry"),
    "cu_k-2d": ((t([0, 2, 5]), t([[0, 4, 9]]), 3, 5), {}, ValueError,
                r"cu_k must be 1-D with at least one entry .*got shape \(1, 3\)"),
    "cu_q-float": ((torch.tensor([0.0, 2.0, 5.0]), t([0, 4, 9]), 3, 5), {}, TypeError,
                   r"cu_q must hold integers \(int32\), got dtype torch\.float32"),
    "cu_k-bool": ((t([0, 2, 5]), torch.tensor([False, True, True]), 3, 5), {}, TypeError,
                  r"cu_k must hold integers \(int32\), got dtype torch\.bool"),
    "segments-differ": ((t([0, 2, 5]), t([0, 9]), 3, 9), {}, ValueError,
                        r"cu_q has 3 entries \(2 segments\) and cu_k 2 \(1 segments\)"),
    "cu_q-start": ((t([1, 2, 5]), t([0, 4, 9]), 3, 5), {}, ValueError, r"cu_q must start at 0, got cu_q\[0\] = 1"),
    "cu_k-start": ((t([0, 2, 5]), t([-1, 4, 9]), 3, 5), {}, ValueError, r"cu_k must start at 0, got cu_k\[0\] = -1"),
    "cu_k-decreasing": ((t([0, 2, 5]), t([0, 9, 4]), 3, 9), {}, ValueError,
                        r"cu_k must be non-decreasing \(segment lengths >= 0\), got cu_k\[1\] = 9 > cu_k\[2\] = 4"),
    "cu_q-int64-overflow": ((torch.tensor([0, 2, 2**31]), t([0, 4, 9]), 3, 5), {}, ValueError,
                            r"cu_q holds 2147483648, outside int32"),
    "max_q-short": ((t([0, 2, 5]), t([0, 4, 9]), 2, 5), {}, ValueError,
                    r"max_q = 2 is below the longest segment \(3 tokens\)"),
    "max_k-float": ((t([0, 2, 5]), t([0, 4, 9]), 3, 5.0), {}, TypeError, r"max_k must be an int, got float 5\.0"),
    "window": (GOOD, dict(window_left=-3), ValueError,
               r"window_left must be an int >= 0, or -1 for no window; got -3"),
    "window-float": (GOOD, dict(window_left=2.5), ValueError, r"window_left .*got 2\.5"),
    "sm_scale-negative": (GOOD, dict(sm_scale=-0.1), ValueError, r"sm_scale must be a finite float > 0.*got -0\.1"),
    "sm_scale-inf": (GOOD, dict(sm_scale=float("inf")), ValueError, r"sm_scale .*got inf"),
}


@pytest.mark.parametrize("bad", list(BAD), ids=str)
def test_bad_plan_refused_by_name_and_previous_plan_kept(wrapper, data, bad):
    q, k, v = data
    wrapper.plan(*GOOD, dtype=BF16)
    before = wrapper.run(q, k, v)
    args, kw, exc, match = BAD[bad]
    with pytest.raises(exc, match=match) as e:
        wrapper.plan(*args, dtype=BF16, **kw)
    assert f"{type(wrapper).__name__}.plan" in str(e.value)
    assert torch.equal(wrapper.run(q, k, v), before)


def test_an_empty_cu_before_any_plan_is_refused_and_run_still_says_before_plan(wrapper, data):
    q, k, v = data
    with pytest.raises(ValueError, match=r"cu_q must be 1-D with at least one entry"):
        wrapper.plan(t([]), t([]), 0, 0, dtype=BF16)
    with pytest.raises(RuntimeError, match="before plan"):
        wrapper.run(q, k, v)


def test_zero_segments_and_host_inputs_of_other_kinds_are_accepted(wrapper, data):
    wrapper.plan(t([0]), t([0]), 0, 0, dtype=BF16)  # no segments at all: valid, nothing to attend
    wrapper.plan([0, 2, 5], np.array([0, 4, 9], dtype=np.int64), 3, 5, dtype=BF16)
    q, k, v = data
    assert wrapper.run(q, k, v).shape == q.shape
    assert wrapper._cu_k.dtype == torch.int32


def test_run_names_the_planned_token_counts(wrapper, data):
    q, k, v = data
    wrapper.plan(*GOOD, dtype=BF16)
    with pytest.raises(ValueError,
                       match=r"q has shape \(4, 4, 64\), expected \(5, 4, 64\) \(the plan's cu_q\[-1\] = 5"):
        wrapper.run(q[:4], k, v)
    with pytest.raises(ValueError,
                       match=r"v has shape \(8, 2, 64\), expected \(9, 2, 64\) \(the plan's cu_k\[-1\] = 9"):
        wrapper.run(q, k, v[:8])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_run_refuses_inputs_on_different_devices(wrapper, data, which):
    q, k, v = data
    wrapper.plan(*GOOD, dtype=BF16)
    moved = {"q": q, "k": k, "v": v}
    moved[which] = moved[which].to("meta")
    if which == "q":
        match = r"run: k is on cpu but q is on meta"
    else:
        match = rf"run: {which} is on meta but q is on cpu"
    with pytest.raises(ValueError, match=match):
        wrapper.run(**moved)


def test_run_refuses_inputs_all_on_another_device_than_planned(wrapper, data):
    q, k, v = data
    wrapper.plan(*GOOD, dtype=BF16)
    with pytest.raises(ValueError, match=r"run: q is on meta, the wrapper plans on cpu"):
        wrapper.run(q.to("meta"), k.to("meta"), v.to("meta"))
