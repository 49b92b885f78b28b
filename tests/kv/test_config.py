"""The paged cache's geometry: every size at least one, query heads a multiple of the KV heads,
and the bytes its storage takes."""

import math

import pytest

from mstar_core import KVConfig
from mstar_core.errors import InputError

SIZES = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "page_size": 4, "max_pages": 16}


@pytest.mark.parametrize("name", list(SIZES))
@pytest.mark.parametrize("bad", [0, -1])
def test_each_size_below_one_is_refused_by_name(name, bad):
    with pytest.raises(InputError, match=rf"KVConfig\.{name} must be >= 1, got {bad}"):
        KVConfig(**{**SIZES, name: bad})


@pytest.mark.parametrize("bad", [0, -2])  # -2 is a multiple of the 2 KV heads: refused all the same
def test_query_heads_below_one_are_refused(bad):
    with pytest.raises(InputError, match=rf"num_qo_heads must be >= 1 .* got {bad}"):
        KVConfig(**SIZES, num_qo_heads=bad)


def test_query_heads_default_to_the_kv_heads_and_must_be_a_multiple_of_them():
    assert KVConfig(**SIZES).qo_heads == 2
    assert KVConfig(**SIZES, num_qo_heads=6).qo_heads == 6
    with pytest.raises(InputError, match=r"num_qo_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        KVConfig(**SIZES, num_qo_heads=3)


@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_storage_bytes_is_every_element_of_the_shape_at_itemsize(itemsize):
    cfg = KVConfig(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, max_pages=5)
    assert cfg.shape == (3, 5, 2, 4, 2, 8)  # layers, pages, K and V, slots, heads, head_dim
    assert cfg.storage_bytes(itemsize) == 3 * 5 * 2 * 4 * 2 * 8 * itemsize
    assert isinstance(cfg.storage_bytes(itemsize), int) and math.prod(cfg.shape) == 1920
