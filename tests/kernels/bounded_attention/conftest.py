"""The bounded attention kernels' tests: the Triton kernels loaded under the Triton interpreter
(CPU tensors)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

import mstar_core.kernels.bounded_attention as ba


@pytest.fixture(scope="session")
def triton_interp():
    """The Triton kernels, loaded a second time under the interpreter (runs on CPU tensors).

    The interpreter must be switched on before triton itself is imported (triton.language's
    own helpers are decorated then), so this runs only where nothing imported triton yet, and
    only without a GPU: the GPU tests run the compiled kernel, and the switch stays on."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/kernels/bounded_attention/test_gpu_bounded.py runs the compiled kernel")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before the interpreter could be switched on")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    spec = importlib.util.spec_from_file_location(
        "mstar_bounded_triton_interp", os.path.join(ba.__path__[0], "triton_kernel.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert isinstance(mod._bounded_fwd, InterpretedFunction), "kernel was not loaded under the interpreter"
    return mod
