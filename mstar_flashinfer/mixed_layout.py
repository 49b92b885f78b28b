"""The host arithmetic of a mixed step: how one packed batch of decode rows and prompt rows splits
into a decode plan over every row and a prefill plan over the prompt rows, and how the
two outputs are put back in packed order. Pure numpy, one pass per array, no loop over rows."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class MixedLayout(NamedTuple):
    # decode plan, one row per input row: a one-token row attends its own pages, any other row
    # one token of the sink page (its output is dropped)
    dec_indptr: np.ndarray
    dec_indices: np.ndarray
    dec_last: np.ndarray
    dec_lens: np.ndarray
    # prefill plan over the prompt rows only, their tokens first in ``perm``
    pre_qo: np.ndarray
    pre_indptr: np.ndarray
    pre_indices: np.ndarray
    pre_last: np.ndarray
    pre_lens: np.ndarray
    row_token: np.ndarray  # [decode_rows_static] int64: the token a row's decode query is read from
    perm: np.ndarray  # [tokens] int64: prompt tokens first, then every other token
    gather: np.ndarray  # [tokens] int64: out[t] = cat(decode_out[rows_static], prefill_out)[gather[t]]
    prompt_rows: int


def split_mixed(
    qo: np.ndarray, indptr: np.ndarray, indices: np.ndarray, last: np.ndarray, lens: np.ndarray,
    sink_page: int, decode_rows_static: int,
) -> MixedLayout:
    """``decode_rows_static``: the decode output's row count (the bucket's rows), which is where
    the prefill outputs start in the concatenated output buffer."""
    rows = qo.shape[0] - 1
    n = int(qo[-1])
    q_lens = np.diff(qo)
    n_pages = np.diff(indptr)
    dec = q_lens == 1  # a one-token row, prompt or not, is exactly a decode query over its pages
    prompt = q_lens > 1
    row_ids = np.arange(rows)
    page_row = np.repeat(row_ids, n_pages)

    dn = np.where(dec, n_pages, 1).astype(np.int32)
    dec_indptr = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(dn, out=dec_indptr[1:])
    dec_indices = np.full(int(dec_indptr[-1]), sink_page, dtype=np.int32)
    dec_indices[np.repeat(dec, dn)] = indices[dec[page_row]]
    dec_last = np.where(dec, last, 1).astype(np.int32)
    dec_lens = np.where(dec, lens, 1).astype(np.int32)

    pr = row_ids[prompt]
    pre_qo = np.zeros(pr.shape[0] + 1, dtype=np.int32)
    np.cumsum(q_lens[pr], out=pre_qo[1:])
    pre_indptr = np.zeros(pr.shape[0] + 1, dtype=np.int32)
    np.cumsum(n_pages[pr], out=pre_indptr[1:])
    pre_indices = indices[prompt[page_row]]

    tok_row = np.repeat(row_ids, q_lens)
    is_prompt_tok = prompt[tok_row]
    perm = np.concatenate([np.flatnonzero(is_prompt_tok), np.flatnonzero(~is_prompt_tok)])
    inv = np.empty(n, dtype=np.int64)
    inv[perm] = np.arange(n)
    gather = np.where(is_prompt_tok, decode_rows_static + inv, tok_row)
    # every static decode row reads some token in range; rows past ``rows`` are padding
    row_token = np.zeros(decode_rows_static, dtype=np.int64)
    row_token[:rows] = np.minimum(qo[:-1], max(n - 1, 0))
    return MixedLayout(dec_indptr, dec_indices, dec_last, dec_lens, pre_qo, pre_indptr, pre_indices,
                       last[pr], lens[pr], row_token, perm, gather, int(pr.shape[0]))
