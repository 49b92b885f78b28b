"""What the registry reads of a device: its cache key, whether it exists, its compute capability
and architecture -- each None, not an error, where the device has none."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mstar_core.registry.device import compute_capability, device_arch, device_key, device_unavailable

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_key_of_a_gpu_keeps_its_index_and_names_device_0_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_key(torch.device("cuda:1")) == "cuda:1"
    assert device_key(CUDA) == "cuda:0"


def test_an_index_past_the_visible_gpus_does_not_exist(fake_gpu):
    fake_gpu("sm90")
    assert device_unavailable(torch.device("cuda:0")) is None
    assert device_unavailable(torch.device("cuda:1")) == "device cuda:1 does not exist (1 GPU(s) visible)"


@pytest.mark.parametrize("arch", ["sm90", "gfx942"])
def test_the_cpu_has_no_capability_or_architecture_beside_a_gpu(fake_gpu, arch):
    fake_gpu(arch)
    assert (compute_capability(CPU), device_arch(CPU)) == (None, None)


def test_an_amd_gpu_has_an_architecture_but_no_compute_capability(fake_gpu):
    fake_gpu("gfx942")
    assert (compute_capability(CUDA), device_arch(CUDA)) == (None, "gfx942")


@pytest.mark.parametrize("hip", [None, "6.3.0"])
def test_a_gpu_that_is_not_usable_has_no_capability_or_architecture(monkeypatch, hip):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert (compute_capability(CUDA), device_arch(CUDA)) == (None, None)


@pytest.mark.parametrize("name", [None, "", ":xnack-"])
def test_an_amd_gpu_naming_no_architecture_has_none(fake_gpu, monkeypatch, name):
    fake_gpu("gfx942")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: SimpleNamespace(gcnArchName=name))
    assert device_arch(CUDA) is None
