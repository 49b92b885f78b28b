"""Kernel dispatch: the registered name resolves, auto / forced choices, clear errors."""

from __future__ import annotations

import pytest
import torch

from mstar_core import bounded_attention
from mstar_core.kernels import bounded_attention as pkg
from mstar_core.kernels.bounded_attention import pick_impl


def test_the_registry_lists_the_kernel_under_bounded():
    from mstar_core import select_backend

    sel = select_backend(capabilities=("bounded",), requested="auto", device=torch.device("cpu"))
    assert sel.name == "reference" and sel.classes["bounded"] is bounded_attention


def test_auto_is_reference_on_cpu_and_env_overrides(monkeypatch):
    assert pick_impl(torch.device("cpu")) == "reference"
    monkeypatch.setattr(pkg, "triton_available", lambda: True)
    assert pick_impl(torch.device("cuda")) == "triton"
    monkeypatch.setenv("MSTAR_BOUNDED_IMPL", "reference")
    assert pick_impl(torch.device("cuda")) == "reference"


def test_forcing_triton_where_it_cannot_run_says_why(monkeypatch):
    with pytest.raises(ValueError, match="needs a CUDA tensor, got device cpu"):
        pick_impl(torch.device("cpu"), "triton")
    monkeypatch.setattr(pkg, "triton_available", lambda: False)
    with pytest.raises(ImportError, match="triton is not installed"):
        pick_impl(torch.device("cuda"), "triton")
    with pytest.raises(ValueError, match="'auto', 'reference' or 'triton', got 'fast'"):
        pick_impl(torch.device("cpu"), "fast")


def test_shape_errors_name_expected_and_received():
    q = torch.randn(2, 4, 3, 8)
    k = torch.randn(2, 3, 3, 8)  # 4 query heads are not a multiple of 3
    cache = torch.zeros(2, 1, 3, 5, 16)
    table = torch.zeros(2, pkg.tb.NUM_COLS, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of H"):
        bounded_attention(q, k, k, cache, table, sink=1, window=4)
    k = torch.randn(2, 2, 3, 8)
    with pytest.raises(ValueError, match=r"cache must be \[slots, 1, 2, cap, 16\], got \(2, 1, 3, 5, 16\)"):
        bounded_attention(q, k, k, cache, table, sink=1, window=4)
    cache = torch.zeros(2, 1, 2, 5, 16)
    with pytest.raises(ValueError, match=r"rel_bias is indexed by distance 0..window=4: last dim 5, got 3"):
        bounded_attention(q, k, k, cache, table, sink=1, window=4, query_window=2, rel_bias=torch.zeros(2, 4, 3, 3))
