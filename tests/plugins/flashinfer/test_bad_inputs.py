"""The FlashInfer wrappers refuse index arrays a kernel would read out of bounds with, at plan
(host-side, before anything is staged, so the previous plan stays whole) and at run (the cache
has too few pages, q on another device), with errors naming the bad value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar_core.testing import conformance as C
from mstar_flashinfer.decode import FlashInferDecodeWrapper
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.prefill import FlashInferPrefillWrapper
from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

from ...helpers import case, err, oracle

pytestmark = pytest.mark.usefixtures("standin_flashinfer")
WS = torch.empty(1024, dtype=torch.uint8)
F32 = torch.float32
CPU = torch.device("cpu")
I32 = dict(dtype=torch.int32)


def t(values) -> torch.Tensor:
    return torch.tensor(values, **I32)


# -- (a) the graph-mode capacity boundary: padding rows' sink pages count ----------------------------

def test_decode_padding_sink_pages_past_max_num_pages_refused_and_previous_plan_kept():
    """batch_size=4, max_num_pages=8. Every padding row reads one sink page, which takes a slot of
    the static kv_indices buffer: 2 rows with 7 pages fit on their own (7 <= 8) but not with
    their 2 padding rows (7 + 2 > 8). The wrapper must refuse that by name before FlashInfer's
    plan, and the plan before it must still run, with the same output."""
    w = FlashInferDecodeWrapper(WS, 4, 2, 16, 4, batch_size=4, max_num_pages=8, device=CPU, accelerator_graph=True)
    c0 = case((1, 1), (5, 6))  # 2 + 2 pages, + 2 padding rows = 6 <= 8
    d0 = C.make_paged(c0, "cpu", F32)
    w.plan(d0.kv_indptr, d0.kv_indices, d0.last_page_len, dtype=F32, kv_lens=d0.kv_lens)
    q0 = torch.cat([d0.q, torch.randn(2, *d0.q.shape[1:])])  # the captured shape: batch_size rows
    before = w.run(q0, d0.layer)
    assert err(before[:2], oracle(c0, d0)) < 2e-5

    c1 = case((1, 1), (12, 10), seed=1)  # 4 + 3 = 7 real pages (page ids < 8): only the padding overflows
    d1 = C.make_paged(c1, "cpu", F32)
    assert d1.kv_indices.numel() == 7 and int(d1.kv_indices.max()) < 8
    with pytest.raises(ValueError, match=r"^FlashInferDecodeWrapper\.plan: 7 pages \(\+2 padding rows\) exceed "
                                         r"max_num_pages=8 of the static buffers$"):
        w.plan(d1.kv_indptr, d1.kv_indices, d1.last_page_len, dtype=F32, kv_lens=d1.kv_lens)

    after = w.run(q0, d0.layer)
    assert torch.equal(after, before)
    assert w.planned_tokens == 2
    assert w._bufs["kv_indptr"].tolist() == [0, 2, 4, 5, 6]  # the previous plan's, padding included

    # one page fewer is exactly at the boundary: 6 + 2 = 8 fits
    c2 = case((1, 1), (12, 6), seed=2)
    d2 = C.make_paged(c2, "cpu", F32)
    w.plan(d2.kv_indptr, d2.kv_indices, d2.last_page_len, dtype=F32, kv_lens=d2.kv_lens)
    q2 = torch.cat([d2.q, torch.randn(2, *d2.q.shape[1:])])
    assert err(w.run(q2, d2.layer)[:2], oracle(c2, d2)) < 2e-5


# -- plan-time refusals, each keeping the previous plan ------------------------------------------------

def _decode(graph=False):
    if graph:
        return FlashInferDecodeWrapper(WS, 4, 2, 16, 4, batch_size=4, max_num_pages=16, device=CPU,
                                       accelerator_graph=True)
    return FlashInferDecodeWrapper(WS, 4, 2, 16, 4, device=CPU)


def _prefill(graph=False):
    if graph:
        return FlashInferPrefillWrapper(WS, 4, 2, 16, 4, batch_size=4, max_total_tokens=32, max_num_pages=16,
                                        device=CPU, accelerator_graph=True)
    return FlashInferPrefillWrapper(WS, 4, 2, 16, 4, device=CPU)


def _mixed(graph=None):
    return FlashInferMixedWrapper(WS, WS, 4, 2, 16, 4, 4, 32, 16, 2, CPU)


WRAPPERS = {
    "decode": (_decode, (1, 1)),
    "decode-graph": (lambda: _decode(True), (1, 1)),
    "prefill": (_prefill, (1, 3)),
    "prefill-graph": (lambda: _prefill(True), (1, 3)),
    "mixed": (_mixed, (1, 3)),
}


def _args(kind: str, d: C.PagedData, **over) -> tuple[tuple, dict]:
    a = dict(qo=d.qo_indptr, indptr=d.kv_indptr, indices=d.kv_indices, last=d.last_page_len)
    kw = dict(dtype=F32, kv_lens=d.kv_lens)
    for k, v in over.items():
        (a if k in a else kw)[k] = v
    pos = (a["indptr"], a["indices"], a["last"]) if kind.startswith("decode") else \
        (a["qo"], a["indptr"], a["indices"], a["last"])
    return pos, kw


def _run(kind, w, d):
    q = d.q
    if kind == "decode-graph":
        q = torch.cat([q, q.new_zeros(4 - q.shape[0], *q.shape[1:])])
    return w.run(q, d.layer)


# The base plan: two rows with (6, 7) keys -> kv_indptr [0, 2, 4], last_page_len [2, 3], 4 pages.
BAD = {
    "indptr-float": (dict(indptr=torch.tensor([0.0, 2.0, 4.0])), TypeError,
                     r"kv_indptr must hold integers \(int32\), got dtype torch\.float32"),
    "indptr-2d": (dict(indptr=t([[0, 2, 4]])), ValueError, r"kv_indptr must be 1-D, got shape \(1, 3\)"),
    "indptr-empty": (dict(indptr=t([])), ValueError, r"kv_indptr must have at least one entry"),
    "indptr-start": (dict(indptr=t([1, 2, 4])), ValueError, r"kv_indptr must start at 0, got kv_indptr\[0\] = 1"),
    "indptr-decreasing": (dict(indptr=t([0, 3, 2])), ValueError,
                          r"kv_indptr must be non-decreasing, got kv_indptr\[1\] = 3 > kv_indptr\[2\] = 2"),
    "indptr-past-indices": (dict(indptr=t([0, 2, 5])), ValueError,
                            r"kv_indptr\[-1\] = 5 exceeds len\(kv_indices\) = 4"),
    "indptr-int64-overflow": (dict(indptr=torch.tensor([0, 2, 2**32 + 4])), ValueError,
                              r"kv_indptr holds 4294967300, outside int32"),
    "last-count": (dict(last=t([2])), ValueError, r"last_page_len has 1 entries, expected 2"),
    "last-zero": (dict(last=t([0, 3])), ValueError,
                  r"last_page_len\[0\] = 0 for a row with 2 pages; allowed: 1\.\.4 \(page_size\)"),
    "last-over": (dict(last=t([2, 5])), ValueError, r"last_page_len\[1\] = 5 for a row with 2 pages; allowed: 1\.\.4"),
    "last-negative": (dict(last=t([-1, 3])), ValueError, r"last_page_len\[0\] = -1 for a row with 2 pages"),
    "index-negative": (dict(indices=t([1, -1, 2, 3])), ValueError,
                       r"kv_indices\[1\] = -1 is negative; page indices must be >= 0"),
    "indices-float": (dict(indices=torch.tensor([1.0, 0.0, 2.0, 3.0])), TypeError,
                      r"kv_indices must hold integers \(int32\), got dtype torch\.float32"),
    "kv-lens": (dict(kv_lens=t([6, 99])), ValueError,
                r"kv_lens\[1\] = 99 disagrees with the row's pages \(2 pages, kv_last_page_len 3: 7 tokens\)"),
    "kv-lens-count": (dict(kv_lens=t([6])), ValueError, r"kv_lens has 1 entries, expected 2"),
    "window": (dict(window_left=-2), ValueError, r"window_left must be an int >= 0, or -1 for no window; got -2"),
    "sm-scale": (dict(sm_scale=float("nan")), ValueError, r"sm_scale must be a finite float > 0.*got nan"),
}


@pytest.mark.parametrize("bad", list(BAD), ids=str)
@pytest.mark.parametrize("kind", list(WRAPPERS), ids=str)
def test_bad_plan_refused_by_name_and_previous_plan_kept(kind, bad):
    w, d, c = _planned(kind)
    before = _run(kind, w, d)
    assert err(before[: d.q.shape[0]], oracle(c, d)) < 2e-5

    over, exc, match = BAD[bad]
    pos, kw = _args(kind, d, **over)
    with pytest.raises(exc, match=match) as e:
        w.plan(*pos, **kw)
    assert type(w).__name__ + ".plan" in str(e.value)  # names the wrapper, not only the value
    assert torch.equal(_run(kind, w, d), before)


@pytest.mark.parametrize("kind", ["prefill", "mixed"])
def test_qo_indptr_checked_against_the_rows_and_their_keys(kind):
    w = _prefill() if kind == "prefill" else _mixed()
    c = case((1, 3), (5, 4))
    d = C.make_paged(c, "cpu", F32)
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_lens=d.kv_lens)
    before = w.run(d.q, d.layer)
    for qo, match in [
        (t([0, 1]), r"qo_indptr has 2 entries, expected 3 \(rows \+ 1\)"),
        (t([0, 4, 1]), r"qo_indptr must be non-decreasing, got qo_indptr\[1\] = 4 > qo_indptr\[2\] = 1"),
        (t([0, 1, 9]), r"row 1 has 8 queries but 7 keys"),
    ]:
        with pytest.raises(ValueError, match=match):
            w.plan(qo, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_lens=d.kv_lens)
        assert torch.equal(w.run(d.q, d.layer), before)


def test_graph_mode_refuses_a_page_index_past_max_num_pages():
    """Eager wrappers do not know the cache's size at plan (run checks it); graph mode does."""
    for w, qo in [(_decode(True), None), (_prefill(True), t([0, 1, 2])),
                  (_mixed(), t([0, 1, 3]))]:
        indptr, indices, last = t([0, 1, 2]), t([3, 16]), t([1, 2])
        args = (indptr, indices, last) if qo is None else (qo, indptr, indices, last)
        with pytest.raises(ValueError, match=r"kv_indices\[1\] = 16 is out of range; page indices must be "
                                             r"< max_num_pages=16"):
            w.plan(*args, dtype=F32)


def test_a_row_without_pages_has_last_page_len_zero():
    """What the KV manager plans for a row with no keys; a non-zero last_page_len there would make
    FlashInfer count keys on a page the row does not have."""
    c = case((0, 2), (0, 5))
    d = C.make_paged(c, "cpu", F32)
    assert d.kv_indptr.tolist()[:2] == [0, 0] and d.last_page_len.tolist()[0] == 0
    w = _prefill()
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_lens=d.kv_lens)
    before = w.run(d.q, d.layer)
    assert err(before, oracle(c, d)) < 2e-5
    with pytest.raises(ValueError, match=r"last_page_len\[0\] = 1 for a row with 0 pages; allowed: 0 \(the row has "
                                         r"no pages\)"):
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, t([1, 3]), dtype=F32)
    assert torch.equal(w.run(d.q, d.layer), before)
    dec = _decode()
    dec.plan(t([0, 0, 2]), t([3, 1]), t([0, 2]), dtype=F32, kv_lens=t([0, 6]))
    with pytest.raises(ValueError, match=r"last_page_len\[0\] = 1 for a row with 0 pages; allowed: 0"):
        dec.plan(t([0, 0, 2]), t([3, 1]), t([1, 2]), dtype=F32)


def test_numpy_and_list_inputs_are_checked_alike():
    w = _decode()
    with pytest.raises(TypeError, match=r"kv_indptr must hold integers \(int32\), got dtype torch\.float64"):
        w.plan(np.array([0.0, 1.0]), [0], [1], dtype=F32)
    with pytest.raises(ValueError, match=r"kv_indptr must start at 0, got kv_indptr\[0\] = 2"):
        w.plan([2, 3], [0], [1], dtype=F32)
    w.plan([0, 1], [0], [1], dtype=F32)  # a plain list of ints is fine
    w.plan([0, 0], [], [0], dtype=F32)  # so is one row without pages


# -- run-time refusals ----------------------------------------------------------------------------

def _planned(kind):
    """A wrapper of ``kind`` planned over a two-row case, the case's data, and the case."""
    make, q_lens = WRAPPERS[kind]
    w = make()
    c = case(q_lens, (6 - q_lens[0], 7 - q_lens[1]))
    d = C.make_paged(c, "cpu", F32)
    pos, kw = _args(kind, d)
    w.plan(*pos, **kw)
    return w, d, c


@pytest.mark.parametrize("kind", list(WRAPPERS), ids=str)
def test_run_refuses_a_cache_with_fewer_pages_than_the_plan_reads(kind):
    w, d, _ = _planned(kind)
    top = int(d.kv_indices.max())
    small = C.PagedData(d.q, d.layer[:top], d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, d.kv_lens, d.keys)
    with pytest.raises(ValueError, match=rf"run: the plan reads page {top} but kv_cache_layer has {top} pages"):
        _run(kind, w, small)
    _run(kind, w, d)  # the cache it was planned for


@pytest.mark.parametrize("kind", list(WRAPPERS), ids=str)
def test_run_refuses_q_on_another_device_than_the_cache(kind):
    w, d, _ = _planned(kind)
    meta = C.PagedData(d.q.to("meta"), d.layer, d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, d.kv_lens,
                       d.keys)
    with pytest.raises(ValueError, match=r"run: q is on meta but kv_cache_layer is on cpu"):
        _run(kind, w, meta)


def test_ragged_wrapper_checks_its_cu_arrays_and_devices():
    w = FlashInferPrefixedPrefillWrapper(4, 2, 16, CPU)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(9, 2, 16, generator=gen)
    w.plan(t([0, 2, 5]), t([0, 4, 9]), 3, 5, dtype=F32)
    before = w.run(q, k, k)
    for args, exc, match in [
        ((t([]), t([]), 0, 0), ValueError,
         r"cu_q must have at least one entry \(\[0\] for no rows\), got an empty array"),
        ((t([0, 2, 5]), t([0, 9]), 3, 9), ValueError, r"cu_k has 2 entries, expected 3 \(rows \+ 1\)"),
        ((t([1, 2, 5]), t([0, 4, 9]), 3, 5), ValueError, r"cu_q must start at 0, got cu_q\[0\] = 1"),
        ((t([0, 4, 9]), t([0, 5, 4]), 5, 5), ValueError,
         r"cu_k must be non-decreasing, got cu_k\[1\] = 5 > cu_k\[2\] = 4"),
        ((torch.tensor([0.0, 5.0]), t([0, 9]), 5, 9), TypeError,
         r"cu_q must hold integers \(int32\), got dtype torch\.float32"),
        ((t([0, 2, 5]), t([0, 4, 9]), 2, 5), ValueError,
         r"max_q must be an int >= the longest segment's count \(3\), got 2"),
    ]:
        with pytest.raises(exc, match=match) as e:
            w.plan(*args, dtype=F32)
        assert "FlashInferPrefixedPrefillWrapper.plan" in str(e.value)
        assert torch.equal(w.run(q, k, k), before)
    with pytest.raises(ValueError, match=r"run: k is on meta but q is on cpu"):
        w.run(q, k.to("meta"), k)
