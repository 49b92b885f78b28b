"""CapabilitySpec: the dtypes one capability runs, checked and kept as a tuple."""

from __future__ import annotations

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
