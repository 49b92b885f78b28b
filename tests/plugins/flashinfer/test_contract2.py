"""The FlashInfer wrappers as contract 2.0 backends: built with ``from_size``, planned with the
core's plan objects (the same output as the seed's loose form, which builds that plan), refusing
a plan of another capability and what FlashInfer itself cannot run, each keeping the previous plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mstar_core.plugin import InputError, InputTypeError, Unsupported, WrapperSize, paged_plan, ragged_plan
from mstar_core.testing import conformance as C
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

from ...helpers import case, err, oracle

pytestmark = pytest.mark.usefixtures("standin_flashinfer")
F32 = torch.float32
CPU = torch.device("cpu")
SIZE = WrapperSize(4, 2, 16, CPU, 4, workspace_bytes=2048, options={"backend": "fa2"})
GRAPH = dataclasses.replace(SIZE, batch_size=4, max_total_tokens=32, max_num_pages=16, max_prefill_rows=2,
                            accelerator_graph=True)
KINDS = {"prefill": (FlashInferPrefillWrapper, "paged_prefill", (1, 3)),
         "decode": (FlashInferDecodeWrapper, "paged_decode", (1, 1)),
         "mixed": (FlashInferMixedWrapper, "mixed", (1, 3))}


def _plan(kind: str, d: C.PagedData, **kw) -> object:
    qo = None if kind == "paged_decode" else d.qo_indptr
    return paged_plan(kind, qo, d.kv_indptr, d.kv_indices, d.last_page_len, 4, F32, kv_lens=d.kv_lens, **kw)


def _data(q_lens, seed=0):
    c = case(q_lens, (6 - q_lens[0], 7 - q_lens[1]), seed=seed)
    return c, C.make_paged(c, "cpu", F32)


def test_from_size_makes_its_workspaces_and_reads_the_backend_option():
    pre = FlashInferPrefillWrapper.from_size(SIZE)
    assert pre.backend == "fa2" and pre.workspace_buffer.numel() == 2048
    graph = FlashInferPrefillWrapper.from_size(GRAPH)
    assert graph.workspace_buffer.numel() == 2 * 2048  # its split-KV scratch at the static maximum
    dec = FlashInferDecodeWrapper.from_size(GRAPH)
    assert dec.accelerator_graph and dec.batch_size == 4 and dec.max_total_tokens is None
    mixed = FlashInferMixedWrapper.from_size(GRAPH)
    assert mixed.max_prefill_rows == 2 and mixed._pre.short_rows is False and mixed._dec.backend == "fa2"
    ragged = FlashInferPrefixedPrefillWrapper.from_size(WrapperSize(4, 2, 16, CPU, workspace_bytes=4096))
    assert ragged.workspace_buffer.numel() == 4096 and ragged.backend == "auto"


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_plan_object_computes_what_the_loose_form_does(kind):
    cls, cap, q_lens = KINDS[kind]
    c, d = _data(q_lens)
    w = cls.from_size(GRAPH if kind == "mixed" else SIZE)
    w.plan(_plan(cap, d))
    out = w.run(d.q, d.layer)
    assert err(out, oracle(c, d)) < 2e-5
    loose = cls.from_size(GRAPH if kind == "mixed" else SIZE)
    args = (d.kv_indptr, d.kv_indices, d.last_page_len) if kind == "decode" else \
        (d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len)
    loose.plan(*args, dtype=F32, kv_lens=d.kv_lens)
    assert torch.equal(loose.run(d.q, d.layer), out)
    assert torch.equal(w.kv_write_locations().pages, loose.kv_write_locations().pages)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_plan_of_another_capability_is_refused_and_the_previous_plan_kept(kind):
    cls, cap, q_lens = KINDS[kind]
    _, d = _data(q_lens)
    w = cls.from_size(GRAPH if kind == "mixed" else SIZE)
    w.plan(_plan(cap, d))
    before = w.run(d.q, d.layer)
    other = "paged_prefill" if cap == "mixed" else "mixed"
    with pytest.raises(InputError, match=rf"plan: got a {other} plan; this wrapper runs {cap} plans"):
        w.plan(dataclasses.replace(_plan(cap, d), kind=other))
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(InputError, match=r"got a prefixed_ragged plan"):
        w.plan(ragged_plan(cu, cu, 1, 1, F32))
    with pytest.raises(InputTypeError, match=r"a plan object comes alone"):
        w.plan(_plan(cap, d), d.kv_indptr)
    assert torch.equal(w.run(d.q, d.layer), before)


@pytest.mark.parametrize("kind", ["prefill", "mixed"])
def test_a_row_with_fewer_keys_than_queries_is_refused_naming_it(kind):
    """The core allows it (the contract gives keyless queries zeros); FlashInfer leaves them
    undefined, so its wrappers refuse the plan."""
    cls, cap, _ = KINDS[kind]
    c, d = _data((1, 3))
    w = cls.from_size(GRAPH if kind == "mixed" else SIZE)
    w.plan(_plan(cap, d))
    before = w.run(d.q, d.layer)
    short = paged_plan(cap, torch.tensor([0, 1, 9], dtype=torch.int32), d.kv_indptr, d.kv_indices, d.last_page_len, 4,
                       F32)
    assert not short.keys_cover_queries
    with pytest.raises(InputError, match=r"row 1 has 8 queries but 7 keys"):
        w.plan(short)
    assert torch.equal(w.run(d.q, d.layer), before)


def test_decode_takes_one_query_per_row():
    _, d = _data((1, 1))
    w = FlashInferDecodeWrapper.from_size(SIZE)
    with pytest.raises(Unsupported, match=r"one query per row, got 2; multi-token decode rows run on its prefill"):
        w.plan(_plan("paged_decode", d, query_tokens=2))


def test_mixed_needs_its_page_indices_on_the_host():
    _, d = _data((1, 3))
    w = FlashInferMixedWrapper.from_size(GRAPH)
    on_device = paged_plan("mixed", d.qo_indptr, d.kv_indptr, d.kv_indices.to("meta"), d.last_page_len, 4, F32)
    with pytest.raises(InputError, match=r"give kv_indices on the host"):
        w.plan(on_device)


def test_ragged_refuses_sink_logits_and_keyless_segments():
    w = FlashInferPrefixedPrefillWrapper.from_size(WrapperSize(4, 2, 16, CPU, workspace_bytes=1024))
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(Unsupported, match=r"sink logits are not supported by the FlashInfer dense path"):
        w.plan(ragged_plan(cu_q, cu_k, 3, 5, F32, sink_logits=True))
    with pytest.raises(InputError, match=r"segment 1 has 3 queries but 2 keys"):
        w.plan(ragged_plan(cu_q, torch.tensor([0, 4, 6], dtype=torch.int32), 3, 4, F32))
    with pytest.raises(InputError, match=r"got a paged_prefill plan; this wrapper runs prefixed_ragged plans"):
        one = torch.tensor([0, 1], dtype=torch.int32)
        w.plan(paged_plan("paged_prefill", one, one, one[:1], one[1:], 1, F32))
