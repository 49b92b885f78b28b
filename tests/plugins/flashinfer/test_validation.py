"""Build-time refusals: head_dim, dtype, page size and head counts FlashInfer cannot compute are
refused with an error naming what it can, before any kernel is compiled or run. Head dims and
dtypes come from the backend's one declaration (its BackendSpec)."""

import pytest
import torch

from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.head_dim import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    check_flashinfer_dtype,
    check_flashinfer_head_dim,
)
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.plugin import FLASHINFER
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

pytestmark = pytest.mark.usefixtures("standin_flashinfer")
WS = torch.empty(1024, dtype=torch.uint8)
CUDA = torch.device("cuda")  # only its type is read: nothing here touches a GPU


@pytest.mark.parametrize("d", [64, 128, 256])
def test_supported_head_dims_pass(d):
    check_flashinfer_head_dim(d, CUDA)
    check_flashinfer_head_dim(d)


@pytest.mark.parametrize("d", [16, 80, 96, 192, 512])
def test_other_head_dims_are_refused_on_cuda_only(d):
    with pytest.raises(ValueError, match=rf"head_dim={d}.*\(64, 128, 256\)"):
        check_flashinfer_head_dim(d, CUDA)
    with pytest.raises(ValueError):
        check_flashinfer_head_dim(d)  # None means CUDA
    check_flashinfer_head_dim(d, "cpu")  # CPU tests drive toy head dims through the stand-in


def test_supported_set_is_what_the_sm90_kernels_assert():
    """Of every head_dim up to 512, CUDA accepts exactly the three the kernels are built for."""
    accepted = []
    for d in range(1, 513):
        try:
            check_flashinfer_head_dim(d, "cuda")
            accepted.append(d)
        except ValueError:
            pass
    assert accepted == [64, 128, 256] == list(SUPPORTED_HEAD_DIMS)


def test_the_checks_read_the_one_declaration():
    assert SUPPORTED_HEAD_DIMS == FLASHINFER.head_dims.values
    assert SUPPORTED_DTYPES == tuple(FLASHINFER.dtypes) == (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("build", [
    lambda: FlashInferPrefillWrapper(WS, 8, 2, 96, 16, device=CUDA),
    lambda: FlashInferDecodeWrapper(WS, 8, 2, 96, 16, device=CUDA),
    lambda: FlashInferMixedWrapper(WS, WS, 8, 2, 96, 16, 4, 64, 32, 2, CUDA),
    lambda: FlashInferPrefixedPrefillWrapper(8, 2, 96, CUDA, workspace_buffer=WS),
], ids=["prefill", "decode", "mixed", "ragged"])
def test_wrappers_refuse_a_head_dim_at_construction(build):
    with pytest.raises(ValueError, match=r"head_dim=96"):
        build()


def test_dtype_refused_on_cuda_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"float32.*torch.float16, torch.bfloat16"):
        check_flashinfer_dtype(torch.float32, CUDA)
    check_flashinfer_dtype(torch.bfloat16, CUDA)
    check_flashinfer_dtype(torch.float32, torch.device("cpu"))
    w = FlashInferPrefillWrapper(WS, 8, 2, 128, 16, device=CUDA)  # eager: allocates nothing on the device
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot compute in torch.float32"):
        w.plan(one, one, torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
               dtype=torch.float32)


@pytest.mark.parametrize("ps", [0, -4, 2.0, True])
def test_page_size_refused(ps):
    with pytest.raises(ValueError, match=rf"page_size must be an int >= 1 .*got {ps!r}$"):
        FlashInferPrefillWrapper(WS, 8, 2, 64, ps, device=torch.device("cpu"))


def test_heads_must_group():
    with pytest.raises(ValueError, match=r"num_qo_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        FlashInferDecodeWrapper(WS, 6, 4, 64, 16, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"num_qo_heads must be a positive int, got 0"):
        FlashInferDecodeWrapper(WS, 0, 2, 64, 16, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        FlashInferPrefillWrapper(WS, 4, 2, 0, 16, device=torch.device("cpu"))

