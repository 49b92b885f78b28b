"""The mixed wrapper's own behaviour: the planned permutation, dropped non-decode rows of the
decode plan, static shapes, and its limits."""

import numpy as np
import pytest
import torch

from mstar_core.testing import conformance as C
from mstar_flashinfer.mixed import FlashInferMixedWrapper
from mstar_flashinfer.mixed_layout import split_mixed

from ...helpers import case, err, oracle, shifted

pytestmark = pytest.mark.usefixtures("standin_flashinfer")
WS = torch.empty(1024, dtype=torch.uint8)
F32 = torch.float32


def _mixed(batch=6, tokens=48, pages=64, prefill_rows=2):
    return FlashInferMixedWrapper(WS, WS, 4, 2, 16, 4, batch, tokens, pages, prefill_rows, torch.device("cpu"))


def test_layout_moves_prompt_tokens_to_the_front():
    qo = np.array([0, 1, 4, 5, 7], dtype=np.int32)  # rows: decode, prompt(3), decode, prompt(2)
    indptr = np.array([0, 2, 3, 5, 6], dtype=np.int32)
    indices = np.array([10, 11, 12, 13, 14, 15], dtype=np.int32)
    last = np.array([2, 3, 1, 2], dtype=np.int32)
    lens = np.array([6, 3, 5, 2], dtype=np.int32)
    lay = split_mixed(qo, indptr, indices, last, lens, sink_page=0, decode_rows_static=6)
    assert lay.perm.tolist() == [1, 2, 3, 5, 6, 0, 4]
    assert lay.pre_qo.tolist() == [0, 3, 5] and lay.pre_indices.tolist() == [12, 15]
    # decode plan: every row; prompt rows read one token of the sink page
    assert lay.dec_indptr.tolist() == [0, 2, 3, 5, 6]
    assert lay.dec_indices.tolist() == [10, 11, 0, 13, 14, 0]
    assert lay.dec_last.tolist() == [2, 1, 1, 1] and lay.dec_lens.tolist() == [6, 1, 5, 1]
    # out[t] = cat(decode_out[6 rows], prefill_out)[gather[t]]
    assert lay.gather.tolist() == [0, 6 + 0, 6 + 1, 6 + 2, 2, 6 + 3, 6 + 4]
    assert lay.row_token.tolist() == [0, 1, 4, 5, 0, 0]


def test_non_decode_rows_output_is_dropped_even_over_a_poisoned_sink_page():
    c = case((1, 9, 1, 6), (12, 0, 4, 3), seed=3)
    d = shifted(C.make_paged(c, "cpu", F32), 1)  # page 0: 1e4 everywhere, the sink page
    w = _mixed()
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32, kv_lens=d.kv_lens)
    assert w.prompt_rows == 2
    assert err(w.run(d.q, d.layer), oracle(c, d)) < 2e-5


def test_static_shapes_across_replans():
    w = _mixed()
    ptrs = [w._perm.data_ptr(), w._gather.data_ptr(), w._row_token.data_ptr(),
            w._dec._inner._paged_kv_indices_buf.data_ptr(), w._pre._inner._qo_indptr_buf.data_ptr()]
    steps = [((1, 5, 1, 1, 1, 7), (3, 0, 8, 1, 2, 4)), ((1, 1), (9, 2)), ((4, 1, 1), (0, 0, 5)), ((1, 3, 2), (2, 3, 4))]
    for i, (q, p) in enumerate(steps):
        c = case(q, p, seed=10 + i)
        d = shifted(C.make_paged(c, "cpu", F32), 1)
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
        assert err(w.run(d.q, d.layer), oracle(c, d)) < 2e-5
        n = d.q.shape[0]
        q_static = torch.cat([d.q, torch.randn(48 - n, *d.q.shape[1:])])  # the captured bucket's tokens
        assert err(w.run(q_static, d.layer)[:n], oracle(c, d)) < 2e-5
        assert [w._perm.data_ptr(), w._gather.data_ptr(), w._row_token.data_ptr(),
                w._dec._inner._paged_kv_indices_buf.data_ptr(), w._pre._inner._qo_indptr_buf.data_ptr()] == ptrs
        # both inner plans stay at their static batch sizes
        assert w._dec._inner._batch_size == 6 and w._pre._inner._batch_size == 2


def test_too_many_prompt_rows_is_refused_by_name():
    w = _mixed(prefill_rows=2)
    d = C.make_paged(case((1, 3, 3, 3), (1, 0, 0, 0)), "cpu", F32)
    with pytest.raises(ValueError, match="3 prompt rows .* exceed max_prefill_rows=2"):
        w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)


@pytest.mark.parametrize("q,p,match", [
    ((1,) * 7, (1,) * 7, "7 rows exceed batch_size=6"),
    ((30, 30), (0, 0), "60 tokens"),
    ((1, 2), (200, 70), "exceed max_num_pages=64"),
])
def test_overflow_is_refused_by_name(q, p, match):
    d = C.make_paged(case(q, p), "cpu", F32)
    with pytest.raises(ValueError, match=match):
        _mixed().plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)


def test_write_locations_in_packed_order():
    c = case((1, 3), (4, 2))
    d = C.make_paged(c, "cpu", F32)
    w = _mixed()
    w.plan(d.qo_indptr, d.kv_indptr, d.kv_indices, d.last_page_len, dtype=F32)
    pages, offs = w.kv_write_locations()
    idx = d.kv_indices.tolist()
    # row 0 (5 keys, pages idx[0:2]): position 4; row 1 (5 keys, pages idx[2:4]): positions 2, 3, 4
    assert pages.tolist() == [idx[1], idx[2], idx[2], idx[3]]
    assert offs.tolist() == [0, 2, 3, 0]
