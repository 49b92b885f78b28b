"""The reference backend's numerics: non-finite values never cross rows and are never
hidden, and the row-chunked / query-blocked path is exact and stays within its budget."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from mstar_core.backends import reference as R
from mstar_core.backends.reference import math as RM
from mstar_core.testing import conformance as C
from mstar_core.testing.oracle import attention_oracle, rel_error

PS, HKV, GQA, D = 4, 2, 2, 16
HQ = HKV * GQA
FILLS = [pytest.param(float("nan"), id="nan"), pytest.param(float("inf"), id="inf"),
         pytest.param(float("-inf"), id="-inf")]


# -- a paged batch whose page table we control -----------------------------------------------------


@dataclasses.dataclass
class Batch:
    q: torch.Tensor  # [tokens, Hq, D]
    layer: torch.Tensor  # [pages, 2, PS, Hkv, D]
    qo: list[int]
    indptr: list[int]
    indices: list[int]
    kv_lens: list[int]
    own: list[list[int]]  # pages listed for each row
    spare: list[int]  # pages nobody lists (freed)

    def tokens(self, row: int) -> range:
        return range(self.qo[row], self.qo[row + 1])

    def clone(self) -> Batch:
        return dataclasses.replace(self, q=self.q.clone(), layer=self.layer.clone())

    def key_slot(self, row: int, j: int) -> tuple[int, int]:
        return self.own[row][j // PS], j % PS


def make_batch(rows, spare=1, seed=0, dtype=torch.float32) -> Batch:
    """``rows``: ``(q_len, kv_len, pages listed)`` each; pages scattered by a permutation."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(p for _, _, p in rows) + spare
    perm = torch.randperm(total, generator=gen).tolist()
    layer = (torch.randn((total, 2, PS, HKV, D), generator=gen) * 0.5).to(dtype)
    q = torch.randn((sum(r[0] for r in rows), HQ, D), generator=gen).to(dtype)
    qo, indptr, indices, own = [0], [0], [], []
    for q_len, _, pages in rows:
        own.append(perm[len(indices):len(indices) + pages])
        indices.extend(own[-1])
        indptr.append(len(indices))
        qo.append(qo[-1] + q_len)
    return Batch(q, layer, qo, indptr, indices, [r[1] for r in rows], own, perm[len(indices):])


def run_paged(b: Batch, causal=True, window_left=-1, wrapper=R.ReferencePrefillWrapper) -> torch.Tensor:
    i32 = torch.int32
    last = [n - (max(-(-n // PS), 1) - 1) * PS for n in b.kv_lens]  # unused: kv_lens is explicit
    w = wrapper(None, HQ, HKV, D, PS)
    tables = (torch.tensor(b.indptr, dtype=i32), torch.tensor(b.indices, dtype=i32), torch.tensor(last, dtype=i32))
    kv_lens = torch.tensor(b.kv_lens, dtype=i32)
    if wrapper is R.ReferenceDecodeWrapper:
        w.plan(*tables, kv_lens=kv_lens, window_left=window_left)
    else:
        w.plan(torch.tensor(b.qo, dtype=i32), *tables, causal=causal, kv_lens=kv_lens, window_left=window_left)
    return w.run(b.q, b.layer)


def oracle(b: Batch, causal=True, window_left=-1) -> torch.Tensor:
    outs = []
    for r, n in enumerate(b.kv_lens):
        kv = b.layer[b.own[r]].permute(1, 0, 2, 3, 4).reshape(2, -1, HKV, D)[:, :n] if b.own[r] else \
            torch.zeros((2, 0, HKV, D), dtype=b.layer.dtype)
        outs.append(attention_oracle(b.q[b.qo[r]:b.qo[r + 1]], kv[0], kv[1], causal, window_left))
    return torch.cat(outs)


def sees(b: Batch, row: int, i: int, j: int, causal: bool, window_left: int) -> bool:
    pos = b.kv_lens[row] - (b.qo[row + 1] - b.qo[row]) + i
    return j < b.kv_lens[row] and (not causal or j <= pos) and (window_left < 0 or j >= pos - window_left)


# -- 1. nothing outside a row reaches it -----------------------------------------------------------


@pytest.mark.parametrize("fill", FILLS)
def test_freed_pages_and_padding_never_reach_any_row(fill):
    """Row 0 lists a page but has kv_len 0 (a freed page: the padding of every other row used to
    read it), one page nobody lists, and the unused tail of every row's last page hold garbage:
    no output changes, bit for bit, and row 0 (sees no key) is zeros."""
    rows = [(1, 0, 0), (3, 9, 3), (1, 2, 1), (5, 5, 2), (2, 13, 4)]
    clean = make_batch(rows, spare=2)
    dirty = clean.clone()
    dirty.layer[clean.own[0]] = fill
    dirty.layer[clean.spare] = fill
    for r, n in enumerate(clean.kv_lens):
        for j in range(n, len(clean.own[r]) * PS):
            p, o = clean.key_slot(r, j)
            dirty.layer[p, :, o] = fill
    for causal, window in ((True, -1), (False, -1), (True, 2)):
        ref = run_paged(clean, causal, window)
        out = run_paged(dirty, causal, window)
        assert torch.isfinite(out).all()
        assert torch.equal(out, ref)
        assert torch.equal(out[clean.tokens(0)], torch.zeros_like(out[clean.tokens(0)]))
        assert rel_error(out, oracle(clean, causal, window)) < C.TOLERANCE[torch.float32]


@pytest.mark.parametrize("fill", FILLS)
def test_another_rows_bad_keys_never_reach_a_batchmate(fill):
    """Every key and value of one row (the first row of the page table, then a middle one) is
    garbage: that row's queries are NaN, every other row's output is unchanged bit for bit, in
    prefill and in decode."""
    for wrapper, rows, seed in (
        (R.ReferencePrefillWrapper, [(3, 9, 3), (1, 2, 1), (4, 4, 1), (1, 11, 3)], 1),
        (R.ReferenceDecodeWrapper, [(1, 9, 3), (1, 2, 1), (1, 4, 1), (1, 11, 3)], 2),
    ):
        clean = make_batch(rows, seed=seed)
        ref = run_paged(clean, wrapper=wrapper)
        for victim in (0, 2):
            dirty = clean.clone()
            dirty.layer[clean.own[victim]] = fill
            out = run_paged(dirty, wrapper=wrapper)
            for r in range(len(rows)):
                if r == victim:
                    assert torch.isnan(out[clean.tokens(r)]).all()
                else:
                    assert torch.equal(out[clean.tokens(r)], ref[clean.tokens(r)]), \
                        f"{wrapper.__name__}: row {r} changed by row {victim}'s keys"


# -- 2. a row's own bad data is never hidden, and reaches only the queries that see it -------------


@pytest.mark.parametrize("fill", FILLS[:2])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("causal,window_left,bad_j", [(True, -1, 5), (True, 2, 3), (False, 1, 4)],
                         ids=["causal-future", "causal-window", "full-window"])
def test_own_bad_key_poisons_exactly_the_queries_that_see_it(fill, where, causal, window_left, bad_j):
    """One element of key ``bad_j`` (kv head 1) of row 1 is NaN/inf, in K or in V: the queries of
    row 1 that see key bad_j get NaN in the query heads reading kv head 1; the same row's queries
    that cannot see it (causal future, outside the window) and every other head and row are
    unchanged bit for bit."""
    rows = [(2, 6, 2), (4, 8, 2), (1, 3, 1)]
    clean = make_batch(rows, seed=3)
    dirty = clean.clone()
    p, o = clean.key_slot(1, bad_j)
    dirty.layer[p, 0 if where == "k" else 1, o, 1, 7] = fill
    ref, out = run_paged(clean, causal, window_left), run_paged(dirty, causal, window_left)
    bad_heads = list(range(GQA, 2 * GQA))  # query heads reading kv head 1
    saw, unseen = 0, 0
    for r in range(len(rows)):
        for i, t in enumerate(clean.tokens(r)):
            if r == 1 and sees(clean, 1, i, bad_j, causal, window_left):
                saw += 1
                assert torch.isnan(out[t, bad_heads]).all(), f"query {i} sees the bad key but is finite"
                assert torch.equal(out[t, :GQA], ref[t, :GQA])
            else:
                unseen += r == 1
                assert torch.equal(out[t], ref[t]), f"row {r} query {i} changed"
    assert saw and unseen  # the case separates both kinds of query


@pytest.mark.parametrize("fill", FILLS)
def test_bad_query_poisons_only_itself(fill):
    """A NaN/inf in one head of one query gives NaN in that head of that query only; the same
    row's other queries and the other heads are unchanged. (Today's code made it 0.)"""
    rows = [(3, 7, 2), (2, 2, 1)]
    clean = make_batch(rows, seed=4)
    dirty = clean.clone()
    t_bad = clean.qo[0] + 1
    dirty.q[t_bad, 3, 0] = fill
    ref, out = run_paged(clean), run_paged(dirty)
    assert torch.isnan(out[t_bad, 3]).all()
    keep = torch.ones(out.shape[:2], dtype=torch.bool)
    keep[t_bad, 3] = False
    assert torch.equal(out[keep], ref[keep])


def test_query_that_sees_no_key_returns_zeros():
    """kv_len 0 (no page; a page nobody lists holds NaN), more queries than keys (causal: the first
    queries sit before key 0), and a non-causal row with no key: zeros, even when the query
    itself holds NaN; the oracle agrees; the rest matches the oracle."""
    rows = [(2, 0, 0), (4, 2, 1), (3, 5, 2)]
    b = make_batch(rows, seed=5)
    b.layer[b.own[0]] = float("nan")
    b.q[b.qo[0]] = float("nan")
    for causal in (True, False):
        out = run_paged(b, causal)
        blind = list(b.tokens(0)) + ([b.qo[1], b.qo[1] + 1] if causal else [])
        assert torch.equal(out[blind], torch.zeros_like(out[blind]))
        assert torch.isfinite(out).all()
        clean_rows = [t for t in range(out.shape[0]) if t not in blind]
        ref = oracle(b, causal)
        assert torch.equal(ref[blind], torch.zeros_like(ref[blind]))
        assert rel_error(out[clean_rows], ref[clean_rows]) < C.TOLERANCE[torch.float32]


def _ragged(q_lens, prefix, seed=6):
    gen = torch.Generator().manual_seed(seed)
    k_lens = [p + n for p, n in zip(prefix, q_lens, strict=True)]
    q = torch.randn((sum(q_lens), HQ, D), generator=gen)
    k = torch.randn((sum(k_lens), HKV, D), generator=gen)
    v = torch.randn((sum(k_lens), HKV, D), generator=gen)
    cu_q = [0, *itertools.accumulate(q_lens)]
    cu_k = [0, *itertools.accumulate(k_lens)]
    return q, k, v, cu_q, cu_k


def run_ragged(q, k, v, cu_q, cu_k, causal=True, window_left=-1):
    w = R.ReferencePrefixedPrefillWrapper(HQ, HKV, D)
    longest = (max(b - a for a, b in itertools.pairwise(cu)) for cu in (cu_q, cu_k))
    w.plan(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), *longest, causal=causal,
           window_left=window_left)
    return w.run(q, k, v)


@pytest.mark.parametrize("where", ["k", "v"])
def test_ragged_bad_key_stays_with_the_queries_that_see_it(where):
    """Ragged: a NaN in row 0's last (fresh) key reaches only row 0's last query; row 0's first
    query (causally before it) and rows 1, 2 are unchanged."""
    q, k, v, cu_q, cu_k = _ragged((2, 3, 4), (3, 0, 2))
    ref = run_ragged(q, k, v, cu_q, cu_k)
    (k if where == "k" else v)[cu_k[1] - 1] = float("nan")
    out = run_ragged(q, k, v, cu_q, cu_k)
    assert torch.isnan(out[1]).all()
    assert torch.equal(out[0], ref[0])
    assert torch.equal(out[2:], ref[2:])


# -- 3. the blocked path is exact and bounded -------------------------------------------------------


PAGED = {
    "prefill": (R.ReferencePrefillWrapper, C.PagedCase(PS, D, GQA, (1, 7, 12, 3), (5, 0, 9, 20))),
    "prefill-window": (R.ReferencePrefillWrapper, C.PagedCase(PS, D, GQA, (1, 7, 12, 3), (5, 0, 9, 20), window_left=3)),
    "prefill-full": (R.ReferencePrefillWrapper, C.PagedCase(PS, D, GQA, (1, 7, 12, 3), (5, 0, 9, 20), causal=False)),
    "decode": (R.ReferenceDecodeWrapper, C.PagedCase(PS, D, GQA, (1, 1, 1, 1, 1), (4, 7, 12, 22, 0))),
    "decode-window": (R.ReferenceDecodeWrapper, C.PagedCase(PS, D, GQA, (1, 1, 1, 1), (4, 7, 12, 22), window_left=5)),
    "mixed": (R.ReferenceMixedWrapper, C.PagedCase(PS, D, GQA, (1, 9, 1, 5, 1), (12, 0, 4, 2, 1))),
    "mixed-window": (R.ReferenceMixedWrapper, C.PagedCase(PS, D, GQA, (1, 9, 1, 5), (12, 0, 4, 2), window_left=4)),
}
TINY, MEDIUM = 200, 3000  # floor here is Hq * (max_k + D) = 4 * (23 + 16) = 156


class MatmulSpy:
    """While entered, records the element count of every ``torch.matmul`` result and the scores
    of every SDPA call (queries x keys, which its unfused fallback materialises)."""

    def __enter__(self):
        self.sizes: list[int] = []
        self._real = real = torch.matmul
        self._sdpa = sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(*a, **kw):
            r = real(*a, **kw)
            self.sizes.append(r.numel())
            return r

        def sdpa_spy(q, k, *a, **kw):
            self.sizes.append(q.shape[:-1].numel() * k.shape[-2])
            return sdpa(q, k, *a, **kw)

        torch.matmul = spy
        torch.nn.functional.scaled_dot_product_attention = sdpa_spy
        return self

    def __exit__(self, *exc):
        torch.matmul = self._real
        torch.nn.functional.scaled_dot_product_attention = self._sdpa


def _paged_wrapper(cls, case, data):
    if cls is R.ReferenceMixedWrapper:
        return cls(None, None, HQ, HKV, D, PS, len(case.q_lens), sum(case.q_lens), data.layer.shape[0], 4, "cpu")
    return cls(None, HQ, HKV, D, PS)


def _plan_run_paged(cls, case, data):
    w = _paged_wrapper(cls, case, data)
    if cls is R.ReferenceDecodeWrapper:
        w.plan(data.kv_indptr, data.kv_indices, data.last_page_len, kv_lens=data.kv_lens, window_left=case.window_left)
    else:
        w.plan(data.qo_indptr, data.kv_indptr, data.kv_indices, data.last_page_len, causal=case.causal,
               kv_lens=data.kv_lens, window_left=case.window_left)
    with MatmulSpy() as spy:
        out = w.run(data.q, data.layer)
    return w, out, spy


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")])
@pytest.mark.parametrize("name", list(PAGED))
def test_blocked_paged_equals_single_block_and_oracle(name, dtype, monkeypatch):
    cls, case = PAGED[name]
    data = C.make_paged(case, "cpu", dtype)
    ref = C.paged_oracle(case, data, case.causal)
    w, single, spy = _plan_run_paged(cls, case, data)
    assert len(w._pad.chunks) == 1 and w._pad.chunks[0].q_step == w._pad.chunks[0].max_q
    for budget in (TINY, MEDIUM):
        monkeypatch.setattr(RM, "SCORES_BUDGET", budget)
        w, out, spy = _plan_run_paged(cls, case, data)
        chunks = w._pad.chunks
        assert len(chunks) > 1 or any(c.q_step < c.max_q for c in chunks), "the budget did not split the batch"
        if budget == TINY and name.startswith(("prefill", "mixed")):
            assert any(c.q_step < c.max_q for c in chunks), "no row was split into query blocks"
        assert max(spy.sizes) <= budget, f"a matmul produced {max(spy.sizes)} elements > budget {budget}"
        torch.testing.assert_close(out, single, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-6)
        assert rel_error(out, ref) <= C.TOLERANCE[dtype]
    # budget MEDIUM also builds chunks of several rows (with and without per-row query counts)
    assert any(c.rows > 1 for c in chunks)


@pytest.mark.parametrize("causal,window_left", [(True, -1), (False, -1), (True, 3)])
def test_blocked_ragged_equals_single_block_and_oracle(causal, window_left, monkeypatch):
    q_lens, prefix = (1, 9, 16, 3), (0, 7, 4, 1)
    q, k, v, cu_q, cu_k = _ragged(q_lens, prefix, seed=7)
    single = run_ragged(q, k, v, cu_q, cu_k, causal, window_left)
    ref = torch.cat([attention_oracle(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]],
                                      causal, window_left) for i in range(len(q_lens))])
    assert rel_error(single, ref) <= C.TOLERANCE[torch.float32]
    for budget in (TINY, MEDIUM):
        monkeypatch.setattr(RM, "SCORES_BUDGET", budget)
        with MatmulSpy() as spy:
            out = run_ragged(q, k, v, cu_q, cu_k, causal, window_left)
        assert max(spy.sizes) <= budget
        torch.testing.assert_close(out, single, rtol=1e-6, atol=1e-6)
        assert rel_error(out, ref) <= C.TOLERANCE[torch.float32]


def _tensors(obj, seen=None):
    """Every tensor reachable from ``obj`` through attributes, dataclass fields and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, seen)
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from _tensors(x, seen)


def test_plan_keeps_no_query_by_key_tensor():
    """What a plan keeps for the step (and every layer reuses) is per token, per row or per key
    slot: nothing of ``max_q * max_k`` elements (the old plan kept a [rows, max_q, max_k] mask)."""
    cls, case = PAGED["prefill"]
    data = C.make_paged(case, "cpu", torch.float32)
    w, _, _ = _plan_run_paged(cls, case, data)
    pad = w._pad
    big = pad.max_q * pad.max_k
    found = list(_tensors(w))
    assert found and all(t.numel() < big for t in found), [tuple(t.shape) for t in found if t.numel() >= big]
    q, k, v, cu_q, cu_k = _ragged((1, 9, 16, 3), (0, 7, 4, 1))
    rw = R.ReferencePrefixedPrefillWrapper(HQ, HKV, D)
    rw.plan(torch.tensor(cu_q), torch.tensor(cu_k), 16, 20)
    big = rw._pad.max_q * rw._pad.max_k
    assert all(t.numel() < big for t in _tensors(rw))


def test_a_batch_over_8_gib_of_keys_plans_within_budget():
    """64 prompts of 8192 tokens, 32 query / 8 KV heads of 128 (over 8 GiB of K/V),
    planned only: every scores block and every chunk's gathered K/V stays within the budget
    (a chunk of one row may hold that row's keys), and the plan itself is per token."""
    rows, n, hq, hkv, d = 64, 8192, 32, 8, 128
    lens = torch.full((rows,), n, dtype=torch.int64)
    pad = RM.build_padding(lens, lens, True, -1, torch.device("cpu"), num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    budget = RM.SCORES_BUDGET
    assert sum(c.t1 - c.t0 for c in pad.chunks) == rows * n  # every query is computed
    assert len(pad.chunks) == rows and all(c.q_step < n for c in pad.chunks)
    for c in pad.chunks:
        assert c.rows * hq * c.q_step * (c.max_k + d) <= budget
        assert c.rows * c.max_k * 2 * hkv * d <= budget or c.rows == 1
    assert max(t.numel() for t in _tensors(pad)) <= rows * n


# -- 4. the fused CPU path (one SDPA call per block) ------------------------------------------------


def test_huge_finite_padding_never_reaches_a_row():
    """Padding slots holding finite values whose scores overflow (q . k = inf) change nothing:
    a masked score of inf - inf would be NaN under SDPA's additive mask, so they are zeroed."""
    rows = [(1, 5, 2), (3, 9, 3), (1, 2, 1)]
    clean = make_batch(rows, seed=8)
    dirty = clean.clone()
    for r, n in enumerate(clean.kv_lens):
        for j in range(n, len(clean.own[r]) * PS):
            p, o = clean.key_slot(r, j)
            dirty.layer[p, :, o] = 1e30
    for wrapper in (R.ReferencePrefillWrapper, R.ReferenceDecodeWrapper):
        if wrapper is R.ReferenceDecodeWrapper:
            clean.q, dirty.q, clean.qo, dirty.qo = clean.q[:3], dirty.q[:3], [0, 1, 2, 3], [0, 1, 2, 3]
        assert torch.equal(run_paged(dirty, wrapper=wrapper), run_paged(clean, wrapper=wrapper))


def test_overflowing_sum_of_finite_inputs_stays_exact():
    """Finite values large enough that the per-chunk sum overflows take the per-element path:
    nothing is set to NaN, and the result matches the float64 oracle."""
    b = make_batch([(2, 6, 2), (1, 3, 1)], seed=9)
    for j in (1, 2):  # V of row 0's keys 1 and 2: finite, their sum is inf
        p, o = b.key_slot(0, j)
        b.layer[p, 1, o] = 2e37
    out = run_paged(b)
    assert torch.isfinite(out).all()
    assert rel_error(out, oracle(b)) < C.TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_fused_path_matches_the_scores_path(dtype):
    """Where soft-cap is on, the block's scores are materialised: with a cap far above every
    score (tanh's identity range) both paths give the same attention, in every dtype."""
    b = make_batch([(1, 7, 2), (4, 9, 3), (2, 2, 1)], seed=10, dtype=dtype)
    fused = run_paged(b)
    pad = RM.build_padding(torch.tensor([1, 4, 2]), torch.tensor(b.kv_lens), True, -1, torch.device("cpu"),
                           num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    slots = RM.gather_paged_slots(pad, torch.tensor(b.indptr), torch.tensor(b.indices), PS)
    scored = RM.attend_padded(b.q, b.layer[:, 0], b.layer[:, 1], pad, None, slots, RM.Extras(soft_cap=1e30))
    torch.testing.assert_close(fused, scored, rtol=1e-12 if dtype == torch.float64 else 1e-2, atol=1e-5)
    assert rel_error(fused, oracle(b)) <= C.TOLERANCE[dtype]


def test_non_contiguous_layer_is_read_as_given():
    """A layer view that is not contiguous (no flat view of it) gives the same output."""
    b = make_batch([(1, 7, 2), (3, 9, 3)], seed=11)
    wide = torch.zeros((*b.layer.shape[:-1], 2 * D))
    wide[..., :D] = b.layer
    ref = run_paged(b)
    b.layer = wide[..., :D]
    assert not b.layer.is_contiguous()
    assert torch.equal(run_paged(b), ref)
