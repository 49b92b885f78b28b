"""HeadDims: the head dims a backend runs, and how a refusal names them."""

from __future__ import annotations

import pytest

from mstar_core.registry.spec import HeadDims


@pytest.mark.parametrize("dims,text", [
    (HeadDims(), "any"),
    (HeadDims(maximum=256), "up to 256"),
    (HeadDims(multiple_of=8), "multiples of 8"),
    (HeadDims(multiple_of=8, maximum=256), "multiples of 8 up to 256"),
    (HeadDims(values=(64, 128)), "64, 128"),
])
def test_head_dims_read_as_written(dims, text):
    assert str(dims) == text


def test_by_default_every_positive_head_dim_runs():
    assert [HeadDims().refusal(d) for d in (1, 3, 577)] == [None, None, None]
    assert HeadDims().refusal(0) == "head_dim 0 is not supported (supported: any)"


def test_multiples_up_to_a_maximum_refuse_the_rest():
    dims = HeadDims(multiple_of=8, maximum=256)
    assert [dims.refusal(d) is None for d in (8, 256, 12, 264)] == [True, True, False, False]
