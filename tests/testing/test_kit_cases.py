"""The kit's case tables as docs/PLUGINS.md ("The cases") states them, the names a failure
report gives a case, a WrapperSet's defaults, and the step sequences the re-plan, per-layer
and replay checks walk."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from mstar_core.backends import reference as R
from mstar_core.testing import conformance as C
from mstar_core.testing import reuse

FAMILIES = {"prefill": C.prefill_cases, "decode": C.decode_cases, "mixed": C.mixed_cases, "ragged": C.ragged_cases}


@pytest.mark.parametrize(("case", "name"), [
    (C.PagedCase(16, 64, 4, (1, 7), (0, 5)), "ps16-d64-gqa4-causal-q1_7-p0_5"),
    (C.PagedCase(1, 128, 8, (1,), (3,), causal=False, window_left=0, sm_scale=0.5),
     "ps1-d128-gqa8-full-win0-scale0.5-q1-p3"),
    (C.PagedCase(16, 64, 16, (2,), (0,), num_kv_heads=4, kv_dtype="fp8_e4m3", soft_cap=30.0, sinks=True,
                 poison_row=0, layer=2, scores="below"),
     "ps16-d64-gqa16-kv4-causal-fp8_e4m3-cap30-poison0-layer2-scores_below-sinks-q2-p0"),
    (C.RaggedCase(64, 4, (1, 7), (0, 5)), "d64-gqa4-causal-q1_7-p0_5"),
    (C.RaggedCase(64, 1, (1,), (2,), causal=False, window_left=0, sm_scale=0.25, num_kv_heads=1, soft_cap=5.0,
                  sinks=True, layer=1),
     "d64-gqa1-kv1-full-win0-scale0.25-cap5-layer1-sinks-q1-p2"),
    # more than 8 rows: uniform ones by their count, others by their first six
    (C.RaggedCase(64, 4, (1,) * 8, (2, 3, 4, 5, 6, 7, 8, 9)), "d64-gqa4-causal-q1_1_1_1_1_1_1_1-p2_3_4_5_6_7_8_9"),
    (C.RaggedCase(64, 4, (1,) * 9, tuple(range(9))), "d64-gqa4-causal-q1x9-p0_1_2_3_4_5_etc9"),
])
def test_a_case_is_named_by_every_choice_it_makes(case, name):
    assert str(case) == name


def test_a_case_s_keys_are_its_prefix_and_its_queries():
    assert C.PagedCase(16, 64, 4, (1, 7), (0, 5)).kv_lens == (1, 12)
    assert C.RaggedCase(64, 4, (3, 7), (-2, 5)).kv_lens == (1, 12)


class _CountingDecode(R.ReferenceDecodeWrapper):
    runs = 0

    def run(self, *args, **kwargs):
        type(self).runs += 1
        return super().run(*args, **kwargs)


def test_a_wrapper_set_s_defaults():
    ws = C.WrapperSet("x", device="meta")
    assert (ws.dtype, ws.thorough, ws.device_indices, ws.api_version) == (torch.float32, False, False, None)
    assert ws.workspace().shape == (1 << 20,) and ws.workspace().dtype == torch.uint8
    data = C.make_paged(C.PagedCase(16, 64, 4, (1,), (3,)), "cpu", torch.float32)
    assert ws.indices(data) is data.kv_indices  # index arrays stay on the host unless asked
    case = C.PagedCase(16, 64, 1, (1, 1), (3, 20))
    _CountingDecode.runs = 0
    C.check_decode(C.WrapperSet("x", decode=_CountingDecode), case)
    assert _CountingDecode.runs == 1  # once, unless thorough
    C.check_decode(C.WrapperSet("x", decode=_CountingDecode, thorough=True), case)
    assert _CountingDecode.runs > 2


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_the_plain_cases_cover_what_the_docs_list(kind):
    cases = FAMILIES[kind]()
    assert len({str(c) for c in cases}) == len(cases)
    grid = [c for c in cases if c.window_left < 0 and c.sm_scale is None and max(c.q_lens) <= 64]
    assert {c.head_dim for c in grid} == {64, 128} and {c.gqa for c in grid} == {1, 4, 8}
    assert {c.num_kv_heads for c in cases} == {2}
    if kind != "ragged":
        assert {c.page_size for c in grid} == {1, 16}
    if kind in ("prefill", "ragged"):  # the grid, causal and not, at every page size, head dim and GQA
        keys = {(getattr(c, "page_size", 0), c.head_dim, c.gqa, c.causal) for c in grid}
        assert len(keys) == len({k[:3] for k in keys}) * 2
    assert all(min(c.q_lens) >= 1 for c in cases)  # no row without queries
    # windows that bite on every row, also without the causal mask and with a scale; a scale alone
    assert any(C.window_bites(c) and c.causal and c.sm_scale is None for c in cases)
    assert kind == "decode" or any(C.window_bites(c) and not c.causal for c in cases)
    assert kind != "prefill" or any(C.window_bites(c) and c.sm_scale is not None for c in cases)
    assert any(c.sm_scale is not None and c.window_left < 0 for c in cases)
    if kind != "ragged":  # windows at both of the grid's head dims
        assert {c.head_dim for c in cases if c.window_left >= 0} == {64, 128}
    if kind in ("prefill", "mixed"):
        assert any(q > 64 for c in cases for q in c.q_lens)
    if kind == "prefill":  # uniform rows of 4 queries
        assert any(c.q_lens == (4,) * len(c.q_lens) and len(c.q_lens) > 1 for c in cases)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_the_grid_s_rows_hold_a_single_query_and_a_full_last_page(page_size, decode):
    q, p = C._lens_for(page_size, decode)
    kv = [a + b for a, b in zip(q, p, strict=True)]
    assert 1 in q and len(q) == len(p) == 4
    assert any(n % page_size == 0 for n in kv[1:])  # a row whose keys end exactly on a page boundary
    if decode:  # and rows a key past a page, several pages long
        assert q == (1, 1, 1, 1) and kv == [1, page_size, page_size + 1, 2 * page_size + 4]
    else:
        assert kv == [1, 12, 2 * page_size, 2 * page_size + 4]


def test_the_windowed_mixed_and_decode_cases_at_every_page_size():
    for family, window in ((C.decode_cases, 7), (C.prefill_cases, 5)):
        sizes = [c.page_size for c in family() if c.window_left == window]
        assert sorted(sizes) == ([1, 1, 16, 16] if window == 5 else [1, 16])


@pytest.mark.parametrize("kind", sorted(reuse.STEPS))
def test_the_reuse_steps_run_at_a_layout_the_plain_cases_run(kind):
    plain = {(getattr(c, "page_size", None), c.gqa, c.num_kv_heads) for c in FAMILIES[kind]()}
    for case in reuse.steps(kind, 64):
        assert (getattr(case, "page_size", None), case.gqa, case.num_kv_heads) in plain
    assert reuse.steps(kind, 64)[0].gqa * reuse.KV_HEADS == 8


@pytest.mark.parametrize("kind", sorted(reuse.STEPS))
def test_the_reuse_steps_grow_and_shrink_and_fit_the_graph_sizes(kind):
    cases = reuse.steps(kind)
    for size in (len, sum):  # rows, tokens, and (below) the longest row's keys
        seen = [size(c.q_lens) for c in cases]
        assert any(a < b for a, b in pairwise(seen)) and any(a > b for a, b in pairwise(seen)), size
    longest = [max(c.kv_lens) for c in cases]
    assert any(a < b for a, b in pairwise(longest)) and any(a > b for a, b in pairwise(longest))
    if kind == "ragged":
        return
    # sized for the widest step of any kind
    assert max(len(c.q_lens) for k in ("prefill", "decode", "mixed") for c in reuse.steps(k)) == reuse.BATCH
    for c in cases:
        assert sum(c.q_lens) <= reuse.TOKENS
        assert sum(-(-n // reuse.PAGE_SIZE) for n in c.kv_lens) <= reuse.PAGES
        assert kind != "mixed" or sum(q > 1 for q in c.q_lens) <= reuse.PREFILL_ROWS
    if kind == "prefill":  # prompts over 64 tokens among short ones
        assert any(q > 64 for c in cases for q in c.q_lens) and any(max(c.q_lens) < 64 for c in cases)


def test_the_replayed_multi_token_step_is_uniform_rows_of_a_few_queries_that_fit_the_graph_sizes():
    q, p = reuse.MULTI_TOKEN_STEP
    assert len(set(q)) == 1 and 1 < q[0] <= 8  # uniform rows of a few queries, as multi-token decode
    assert 1 < len(q) <= reuse.BATCH and sum(q) <= reuse.TOKENS and len(p) == len(q)
    assert 0 in p and any(n % reuse.PAGE_SIZE for n in p)  # an empty prefix and a page left part full
    assert sum(-(-(a + b) // reuse.PAGE_SIZE) for a, b in zip(q, p, strict=True)) <= reuse.PAGES
