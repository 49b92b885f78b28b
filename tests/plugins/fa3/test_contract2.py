"""FA3's wrappers as contract 2.0 backends: built with ``from_size``, planned with the core's plan
objects (the loose form builds the same plan), refusing a plan of another capability and what FA3
itself cannot run."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mstar_core.plugin import InputError, Unsupported, WrapperSize, paged_plan, ragged_plan
from mstar_core.testing import conformance as C

from ...helpers import case, err, oracle

BF16 = torch.bfloat16
SIZE = WrapperSize(8, 2, 64, torch.device("cpu"), 16)


@pytest.fixture
def fa3(fa3_standin):
    from mstar_fa3 import paged, ragged

    return SimpleNamespace(FA3PrefillWrapper=paged.FA3PrefillWrapper, FA3DecodeWrapper=paged.FA3DecodeWrapper,
                           FA3MixedWrapper=paged.FA3MixedWrapper,
                           FA3PrefixedPrefillWrapper=ragged.FA3PrefixedPrefillWrapper)


def _data(q_lens, kv_lens):
    c = case(q_lens, tuple(k - q for q, k in zip(q_lens, kv_lens, strict=True)), page_size=16, head_dim=64, gqa=4)
    return c, C.make_paged(c, "cpu", BF16)


def test_plan_objects_and_the_loose_form_agree(fa3):
    c, d = _data((3, 1), (20, 9))
    w = fa3.FA3PrefillWrapper.from_size(SIZE)
    w.plan(paged_plan("paged_prefill", d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, 16, BF16))
    out = w.run(d.q, d.layer)
    assert err(out.float(), oracle(c, d)) < 2e-2
    loose = fa3.FA3PrefillWrapper(None, 8, 2, 64, 16, device="cpu")
    loose.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=BF16)
    assert torch.equal(loose.run(d.q, d.layer), out)


def test_decode_from_size_takes_its_query_tokens(fa3):
    graph = dataclasses.replace(SIZE, batch_size=4, max_num_pages=16, accelerator_graph=True, query_tokens=2)
    w = fa3.FA3DecodeWrapper.from_size(graph)
    assert w.query_tokens == 2 and w.max_total_tokens is None
    _, d = _data((2, 2), (9, 20))
    with pytest.raises(InputError, match=r"built for 2 query tokens per row, planned with 1"):
        w.plan(paged_plan("paged_decode", None, d.kv_indptr, d.kv_indices, d.last_page_len, 16, BF16))
    w.plan(paged_plan("paged_decode", None, d.kv_indptr, d.kv_indices, d.last_page_len, 16, BF16, query_tokens=2))


def test_refusals(fa3):
    _, d = _data((3, 1), (20, 9))
    w = fa3.FA3MixedWrapper.from_size(dataclasses.replace(SIZE, batch_size=4, max_total_tokens=8, max_num_pages=8,
                                                          max_prefill_rows=2, accelerator_graph=True))
    assert not w.accelerator_graph and w.max_prefill_rows == 2  # mixed steps run eagerly
    plan = paged_plan("mixed", d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, 16, BF16)
    with pytest.raises(InputError, match=r"got a paged_prefill plan; this wrapper runs mixed plans"):
        w.plan(dataclasses.replace(plan, kind="paged_prefill"))
    with pytest.raises(Unsupported, match=r"FP8 cache only with FP8 queries"):
        w.plan(dataclasses.replace(plan, kv_data_type=torch.float8_e4m3fn))
    short = paged_plan("mixed", torch.tensor([0, 3, 13], dtype=torch.int32), d.kv_indptr, d.kv_indices,
                       d.last_page_len, 16, BF16)
    with pytest.raises(InputError, match=r"row 1 has 10 queries but 9 keys"):
        w.plan(short)
    r = fa3.FA3PrefixedPrefillWrapper.from_size(WrapperSize(8, 2, 64, torch.device("cpu")))
    with pytest.raises(InputError, match=r"got a mixed plan; this wrapper runs prefixed_ragged plans"):
        r.plan(plan)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    r.plan(ragged_plan(cu, cu, 2, 2, BF16, sink_logits=True))  # FA3 takes sinks at run
