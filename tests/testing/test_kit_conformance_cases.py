"""The conformance module's case tables past the plain grid (edge, numerics, feature cases and
their defaults), which windows count as biting, which refused plans the kit lets pass, and the
data a case builds: its spare pages, its value scales, its FP8 storage and its sink logits."""

from __future__ import annotations

import pytest
import torch

from mstar_core.testing import conformance as C

KINDS = ("prefill", "decode", "mixed", "ragged")
ALL_FEATURES = frozenset({"fp8_e4m3", "fp8_e5m2", "soft_cap", "sink_logits", "layer_windows"})


def _has_decode_and_prompt_rows(case: C.PagedCase | C.RaggedCase) -> bool:
    return 1 in case.q_lens and max(case.q_lens) > 1


@pytest.mark.parametrize(("window_left", "prefix_lens", "bites"), [
    (-1, (10, 20), False),  # no window
    (0, (1, 2), True),  # a window of 0 keeps only the query's own key
    (4, (5, 12), True),
    (4, (4, 12), False),  # the first query of the first row sees every key
    (4, (12, 3), False),  # bites on one row only
])
def test_a_window_bites_only_where_it_removes_keys_from_every_row(window_left, prefix_lens, bites):
    case = C.PagedCase(16, 64, 4, (2,) * len(prefix_lens), prefix_lens, window_left=window_left)
    assert C.window_bites(case) is bites


def _refuse():
    raise ValueError("no")


@pytest.mark.parametrize("prefix_lens", [(0, 3), (5, 0)])
def test_a_plan_refused_where_every_row_sees_a_key_fails(prefix_lens):
    with pytest.raises(ValueError, match="no"):
        C._plan(C.RaggedCase(64, 4, (2, 2), prefix_lens), _refuse)


def test_a_plan_refused_where_a_row_sees_no_key_is_allowed():
    with pytest.raises(C.Refused, match="refused the plan: no"):
        C._plan(C.RaggedCase(64, 4, (2, 2), (-1, 3)), _refuse)
    C._plan(C.RaggedCase(64, 4, (2, 2), (-1, 3)), lambda: None)  # a plan that passes passes


def test_the_mixed_grid_interleaves_decode_rows_with_a_prompt_a_key_past_a_page():
    rows = {(c.page_size, c.q_lens, c.prefix_lens) for c in C.mixed_cases() if c.seed < 600}
    assert rows == {(ps, (1, 9, 1, ps + 1, 1), (12, 0, ps, 2, 1)) for ps in (1, 16)}


def test_the_case_tables_default_to_head_dim_128_and_page_size_16():
    tables = [C.multi_token_cases(), *(t(k) for k in KINDS for t in (C.shape_cases, C.numerics_cases, C.edge_cases)),
              *(C.feature_cases(k, ALL_FEATURES) for k in ("prefill", "decode", "mixed")),
              C.ragged_feature_cases(ALL_FEATURES)]
    assert {c.head_dim for cases in tables for c in cases} == {128}
    assert {c.page_size for k in ("prefill", "decode", "mixed") for c in C.edge_cases(k)} == {16}
    assert {c.page_size for c in C.feature_cases("prefill", ALL_FEATURES)} == {1, 16}


@pytest.mark.parametrize("kind", KINDS)
def test_the_edge_cases_hold_a_poisoned_row_and_rows_that_see_no_key(kind):
    cases = C.edge_cases(kind, 64, page_size=4)
    assert len(cases) == 2 and {c.head_dim for c in cases} == {64}
    poisoned, blind = cases
    assert poisoned.poison_row is not None and not C.no_key_queries(poisoned).any()
    assert blind.poison_row is None and C.no_key_queries(blind).any()
    assert kind == "ragged" or {c.page_size for c in cases} == {4}
    if kind == "mixed":  # decode rows beside prompt rows, in both
        assert all(_has_decode_and_prompt_rows(c) for c in cases)
    if kind == "decode":  # rows without keys at all, first, between others and last
        assert blind.q_lens == (1,) * 6 and [p < 0 for p in blind.prefix_lens] == [1, 0, 1, 0, 0, 1]


@pytest.mark.parametrize("kind", KINDS)
def test_the_numerics_cases_fit_their_kind(kind):
    cases = C.numerics_cases(kind, 64, quick=True)
    assert {c.head_dim for c in cases} == {64}
    assert [c.scores for c in cases] == ["hundreds", "below", "", "hundreds"]
    assert max(max(c.kv_lens) for c in cases) == C.QUICK_LONG_KEYS
    if kind == "decode":
        assert all(set(c.q_lens) == {1} for c in cases)
    if kind == "mixed":
        assert all(_has_decode_and_prompt_rows(c) for c in cases)


def _variants(cases) -> set[tuple]:
    return {(c.kv_dtype, c.soft_cap, c.sinks, c.window_left) for c in cases}


FEATURE_VARIANTS = {("fp8_e4m3", None, False, -1), ("fp8_e5m2", None, False, -1), ("auto", 2.0, False, -1),
                    ("auto", 30.0, False, -1), ("auto", None, True, -1), ("auto", None, True, 3),
                    ("fp8_e4m3", 2.0, False, -1), ("fp8_e4m3", 2.0, True, -1)}


@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_the_feature_cases_run_every_feature_alone_and_combined_on_the_kind_s_rows(kind):
    cases = C.feature_cases(kind, ALL_FEATURES, page_sizes=(1, 16), head_dim=64)
    assert len(cases) == 2 * len(FEATURE_VARIANTS) and _variants(cases) == FEATURE_VARIANTS
    for ps in (1, 16):
        if kind == "mixed":
            rows = {((1, 9, 1, ps + 1, 1), (12, 0, ps, 2, 1))}
        else:
            rows = {C._lens_for(ps, decode=kind == "decode")}
        assert {(c.q_lens, c.prefix_lens) for c in cases if c.page_size == ps} == rows
    assert len({c.seed for c in cases}) == len(cases)


def test_the_feature_cases_leave_out_a_combination_excluded_and_any_holding_it():
    cases = C.feature_cases("decode", ALL_FEATURES, page_sizes=(16,), excludes=(("fp8_e4m3", "soft_cap"),))
    assert _variants(cases) == FEATURE_VARIANTS - {("fp8_e4m3", 2.0, False, -1), ("fp8_e4m3", 2.0, True, -1)}


def test_the_ragged_feature_cases_run_every_feature_alone_and_combined():
    cases = C.ragged_feature_cases(ALL_FEATURES, head_dim=64)
    assert {(c.window_left, c.soft_cap, c.sinks, c.causal) for c in cases} == {
        (5, None, False, True), (-1, 2.0, False, True), (-1, 30.0, False, True), (-1, None, True, True),
        (-1, None, True, False), (5, 2.0, True, True)}
    assert len(cases) == 6 and {c.head_dim for c in cases} == {64}
    assert {(c.q_lens, c.prefix_lens) for c in cases} == {((1, 9, 16, 33), (0, 7, 16, 1))}
    assert len({c.seed for c in cases}) == len(cases)


def test_sink_logits_are_float32_per_query_head_at_the_scores_scale():
    case = C.PagedCase(16, 64, 16, (1,), (3,), num_kv_heads=4, sinks=True, seed=5)
    sinks = C.sink_logits(case, "cpu")
    assert sinks is not None and sinks.shape == (64,) and sinks.dtype == torch.float32
    assert 1.5 < float(sinks.std()) < 2.5  # a spread of about 2: a visible share of each softmax
    assert C.sink_logits(C.PagedCase(16, 64, 16, (1,), (3,), num_kv_heads=4, seed=5), "cpu") is None


@pytest.mark.parametrize("stale_nan", [False, True])
def test_a_paged_case_holds_its_rows_pages_a_poison_page_and_with_stale_nan_a_nan_page(stale_nan):
    case = C.PagedCase(4, 16, 2, (1, 3), (5, 2))
    data = C.make_paged(case, "cpu", torch.float32, stale_nan=stale_nan)
    owned = set(data.kv_indices.tolist())
    assert len(owned) == 2 + 2 and data.layer.shape[0] == len(owned) + 1 + stale_nan
    spare = [data.layer[i] for i in range(data.layer.shape[0]) if i not in owned]
    assert sum(bool((p == 1e4).all()) for p in spare) == 1
    assert sum(bool(p.isnan().all()) for p in spare) == stale_nan


def test_a_paged_case_s_values_have_a_spread_of_one_half():
    data = C.make_paged(C.PagedCase(16, 128, 4, (8, 8), (40, 20)), "cpu", torch.float32)
    assert 0.45 < float(data.layer[data.kv_indices.long()].std()) < 0.55


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_case_stores_k_over_one_half_and_v_over_two(kv_dtype):
    case = C.PagedCase(16, 64, 4, (3, 8), (12, 20))
    plain = C.make_paged(case, "cpu", torch.float32).layer
    fp8 = C.make_paged(C.PagedCase(16, 64, 4, (3, 8), (12, 20), kv_dtype=kv_dtype), "cpu", torch.float32)
    pages = fp8.kv_indices.long()
    for i, scale in ((0, 0.5), (1, 2.0)):  # stored * scale is what a kernel reads
        assert torch.allclose(fp8.layer[pages, i].float() * scale, plain[pages, i], rtol=0.15, atol=0.02 * scale)
    assert torch.equal(fp8.keys[1][1], fp8.layer[pages[1:3], 1].double().reshape(-1, 2, 64)[:28] * 2.0)


@pytest.mark.parametrize("row", [0, 1, 2])
def test_a_poisoned_row_s_pages_and_queries_alone_hold_inf_keys_nan_values_and_nan_queries(row):
    case = C.PagedCase(4, 16, 2, (2, 3, 1), (5, 2, 6), poison_row=row)
    data = C.make_paged(case, "cpu", torch.float32)
    indptr, pages, qo = data.kv_indptr.tolist(), data.kv_indices.long(), data.qo_indptr.tolist()
    for r in range(3):
        own = pages[indptr[r]:indptr[r + 1]]
        poisoned = r == row
        assert bool(data.layer[own, 0].isinf().all()) is poisoned
        assert bool(data.layer[own, 1].isnan().all()) is poisoned
        assert bool(data.q[qo[r]:qo[r + 1]].isnan().all()) is poisoned
        assert not data.keys[r][0].isinf().any() and not data.keys[r][1].isnan().any()  # the oracle's stay clean
    assert not data.q[[i for i in range(qo[-1]) if not qo[row] <= i < qo[row + 1]]].isnan().any()


@pytest.mark.parametrize(("q_lens", "prefix_lens", "causal", "blind"), [
    ((3, 2), (0, 4), False, [False] * 5),
    ((3, 2), (-3, 4), False, [True] * 3 + [False] * 2),  # a full row with no key at all: every query blind
    ((3, 2), (-2, -2), False, [False] * 3 + [True] * 2),  # one key left in the first row, none in the second
    ((3, 2), (-2, 0), True, [True] * 2 + [False] * 3),  # causal: the first -p queries see no key
])
def test_the_queries_that_see_no_key_are_named_per_row(q_lens, prefix_lens, causal, blind):
    case = C.RaggedCase(64, 4, q_lens, prefix_lens, causal=causal)
    assert C.no_key_queries(case).tolist() == blind


def test_an_output_on_the_current_gpu_is_on_the_device_named_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert C._same_device(torch.device("cuda", 1), torch.device("cuda"))
    assert not C._same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert not C._same_device(torch.device("cuda", 1), torch.device("cuda", 0))
    assert not C._same_device(torch.device("cpu"), torch.device("cuda"))
    assert C._same_device(torch.device("cuda"), torch.device("cuda"))  # no index on either: the current one
    assert C._same_device(torch.device("cpu"), torch.device("cpu"))
    assert C._same_device(torch.device("cpu", 0), torch.device("cpu"))
