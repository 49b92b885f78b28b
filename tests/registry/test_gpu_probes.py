"""On a real GPU: the probes answer from the installed libraries (FA3's tiny call runs for
real), and ``mstar backends``' data is written to $OUT/registry_gpu.json when OUT is set.

    source .gpu/env.sh fa3 && python -m pytest tests/registry/test_gpu_probes.py -m gpu
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from mstar_core import Registry, dense_selection
from mstar_core.cli.backends import collect
from mstar_core.registry.device import device_arch


@pytest.mark.gpu
def test_real_probes_on_this_gpu():
    reg = Registry()
    dev = torch.device("cuda")
    data = collect(reg, dev, torch.bfloat16, 128)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "registry_gpu.json").write_text(json.dumps(data, indent=2))
    assert reg.failures == [], reg.failures
    arch = device_arch(dev)
    if reg.get("flashinfer") is not None and importlib.util.find_spec("flashinfer"):
        assert reg.reasons("flashinfer", device=dev) == []
    if reg.get("fa3") is not None and importlib.util.find_spec("flash_attn_interface") and arch == "sm90":
        assert reg.reasons("fa3", device=dev) == []  # the tiny call ran and passed
        assert dense_selection(dev, torch.bfloat16, 128, registry=reg).name == "fa3"
    if reg.get("fa3") is not None and importlib.util.find_spec("flash_attn_interface") is None:
        assert any("flash_attn_interface is not installed" in r for r in reg.reasons("fa3", device=dev))
