"""CapabilitySpec: the dtypes and head dims one capability runs, checked and kept as a tuple."""

from __future__ import annotations

import re

import pytest
import torch

from mstar_core.errors import InputTypeError
from mstar_core.registry.spec import CapabilitySpec


def test_dtypes_given_as_a_list_are_kept_as_a_tuple():
    assert CapabilitySpec(dtypes=[torch.float16]).dtypes == (torch.float16,)


@pytest.mark.parametrize("dtypes", [torch.float16, (torch.float16, "bfloat16"), ("float16",)])
def test_dtypes_that_are_not_all_torch_dtypes_are_refused(dtypes):
    with pytest.raises(InputTypeError, match="CapabilitySpec: dtypes must be a tuple of torch dtypes"):
        CapabilitySpec(dtypes=dtypes)


@pytest.mark.parametrize("head_dims", [64, (64, 128), "any"])
def test_head_dims_that_are_not_a_head_dims_are_refused(head_dims):
    match = "CapabilitySpec: head_dims must be a HeadDims, got " + re.escape(repr(head_dims))
    with pytest.raises(InputTypeError, match=match):
        CapabilitySpec(head_dims=head_dims)
