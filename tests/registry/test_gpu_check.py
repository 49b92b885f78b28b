"""On the GPU: `mstar check` against the real kernel libraries (FlashInfer, FA3) in bf16 at head
dim 128 (its modules come precompiled; other head dims are JIT compiles of 20-80 s each)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mstar_core.registry import reset_registry
from mstar_core.testing.check import check_backend

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,module", [("flashinfer", "flashinfer"), ("fa3", "flash_attn_interface")])
def test_mstar_check_passes_on_the_gpu(name, module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here")
    reset_registry()
    report = check_backend(name, device="cuda", dtypes=[torch.bfloat16], head_dims=[128])
    print(report.render())
    assert report.ok, report.render(all_rows=False)
    groups = {r.group for r in report.results}
    assert {"plain", "edge", "replan"} <= groups
    if name == "flashinfer":
        assert "replay" in groups
