"""Which cases, head dims and dtypes ``mstar check`` picks and refuses (docs/PLUGINS.md, "Testing"):
the ``--quick`` subset of the plain cases, a case moved to the nearest checked head dim, what a
run names as left out, the arguments it refuses, and the summary's count of failures by rule."""

from __future__ import annotations

import torch

from mstar_core.backends import reference as R
from mstar_core.registry.spec import BackendSpec, CapabilitySpec, HeadDims
from mstar_core.testing import check as K

F32 = torch.float32
DECODE = "mstar_core.backends.reference:ReferenceDecodeWrapper"
PREFILL = "mstar_core.backends.reference:ReferencePrefixedPrefillWrapper"
CLASSES = {"paged_decode": R.ReferenceDecodeWrapper}


def _spec(dims: HeadDims, dtypes=(F32,), per_capability=None) -> BackendSpec:
    provides = {"paged_decode": DECODE}
    if per_capability:
        provides["paged_prefill"] = PREFILL
    return BackendSpec(name="sel", provides=provides, devices=("cpu",), dtypes=dtypes, head_dims=dims,
                       api_version="1.1", per_capability=per_capability or {})


def test_a_capability_checked_at_no_head_dim_says_so():
    spec = _spec(HeadDims(multiple_of=13), per_capability={"paged_prefill": CapabilitySpec(head_dims=HeadDims(
        values=(64,)))})
    classes = {**CLASSES, "paged_prefill": R.ReferencePrefixedPrefillWrapper}
    assert K.left_out(spec, classes, None, None, False) == {
        "paged_decode head dims": "declares multiples of 13; checked none (the suite checks none it allows)"}
