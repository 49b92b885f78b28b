"""The split-K decode wrapper of ``splitk_decode.py`` and its slips, registered in-process as
third-party backends: the clean one matches the float64 oracle on a long row of large scores and
passes ``mstar check``; each slip fails it, in the group and under the rule expected, with the
smallest selection of groups, head dims and dtypes that catches it. A plan whose ``kv_indptr``
does not start at 0 never reaches a wrapper: the core refuses it."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch

from mstar_core import BackendSpec, Registry
from mstar_core.attention.plans import paged_plan
from mstar_core.errors import InputError
from mstar_core.registry.spec import HeadDims
from mstar_core.testing import check as K
from mstar_core.testing import numerics
from mstar_core.testing.oracle import attention_oracle, rel_error

from . import splitk_decode as S

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
MODULE = "mstar_splitk_slips_kit"
CLEAN = "splitk"
# The case of the decode edge group with rows that have no pages (kv_lens 0), between others.
EMPTY_ROWS = "-p-1_20_-1_41_16_-1"
# What a NaN failure says once the kit has zeroed the slots no row owns and still sees NaN.
OVERFLOWS = "the kernel's own arithmetic overflows or divides by zero"

# name -> (wrapper, check_backend arguments that catch it (quick=True), the rule every failure
# names, the group of every failure, a substring of some failing case's name, of its message)
SLIPS: dict[str, tuple[type, dict[str, Any], str, str, str, str]] = {
    "merge_last_chunk_max": (S.SplitKMergeLastChunkMax, {"groups": ["numerics"], "dtypes": [F32]}, "oracle",
                             "numerics", "-scores_hundreds-", OVERFLOWS),
    "fp16_exp_without_max": (S.SplitKFp16ExpWithoutMax, {"groups": ["numerics"], "dtypes": [F16]}, "oracle",
                             "numerics", "-scores_hundreds-", OVERFLOWS),
    "max_from_zero": (S.SplitKMaxFromZero, {"groups": ["numerics"], "dtypes": [F32]}, "oracle", "numerics",
                      "-scores_below-", OVERFLOWS),
    "bf16_accumulators": (S.SplitKBf16Accumulators, {"groups": ["numerics"], "dtypes": [F32]}, "oracle", "numerics",
                          "-p8191_", "relative error"),
    "first_128_dims": (S.SplitKFirst128Dims, {"groups": ["plain"], "dtypes": [F32], "head_dims": [256]}, "oracle",
                       "plain", "-d256-", "relative error"),
    "empty_row_nan": (S.SplitKEmptyRowNaN, {"groups": ["edge"], "dtypes": [F32]}, "no-key", "edge", EMPTY_ROWS,
                      "a query that sees no key"),
    "rows_shifted_after_empty": (S.SplitKRowsShiftedAfterEmpty, {"groups": ["edge"], "dtypes": [F32]}, "oracle",
                                 "edge", EMPTY_ROWS, "relative error"),
}


@pytest.fixture
def splitk(monkeypatch) -> Registry:
    mod = types.ModuleType(MODULE)
    monkeypatch.setitem(sys.modules, MODULE, mod)
    reg = Registry(discover=False)
    for name, cls in {CLEAN: S.SplitKDecode, **{n: s[0] for n, s in SLIPS.items()}}.items():
        setattr(mod, name, cls)
        reg.register(BackendSpec(name=name, provides={"paged_decode": f"{MODULE}:{name}"}, devices=("cpu", "cuda"),
                                 dtypes=S.DTYPES, head_dims=HeadDims(multiple_of=8, maximum=256), api_version="1.1"))
    return reg


# -- the clean wrapper ---------------------------------------------------------------------------


Rows = list[tuple[torch.Tensor, torch.Tensor]]


def _paged_rows(lens: list[int], hkv: int, g: int, d: int, ps: int, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, Rows, dict[str, torch.Tensor]]:
    """One query per row aimed at a unit direction per KV head, so its score with key j is about
    ``offset_j`` (per 96-key stretch, in -300..300: the first stretch +300, the last -300); the
    rows' keys scattered over pages, NaN in every slot no row owns. Returns q, the layer, each
    row's (k, v) and the plan's arrays."""
    u = torch.randn((hkv, d), generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    q = (u.repeat_interleave(g, 0)[None] + 0.03 * torch.randn((len(lens), hkv * g, d), generator=gen)) * math.sqrt(d)
    n_pages = [-(-n // ps) for n in lens]
    layer = torch.full((sum(n_pages) + 1, 2, ps, hkv, d), float("nan"))
    perm = torch.randperm(layer.shape[0], generator=gen)
    rows, indptr, last, cursor = [], [0], [], 0
    for n, pages in zip(lens, n_pages, strict=True):
        offsets = numerics.row_offsets("spread", n, gen).float()
        k = 0.5 * torch.randn((n, hkv, d), generator=gen) + offsets[:, None, None] * u
        v = torch.randn((n, hkv, d), generator=gen)
        own = perm[cursor:cursor + pages]
        cursor += pages
        for i, page in enumerate(own.tolist()):
            layer[page, 0, :min(ps, n - i * ps)] = k[i * ps:(i + 1) * ps]
            layer[page, 1, :min(ps, n - i * ps)] = v[i * ps:(i + 1) * ps]
        rows.append((k, v))
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * ps if pages else 0)
    i32 = torch.int32
    arrays = {"paged_kv_indptr": torch.tensor(indptr, dtype=i32), "paged_kv_indices": perm[:cursor].to(i32),
              "paged_kv_last_page_len": torch.tensor(last, dtype=i32), "kv_lens": torch.tensor(lens, dtype=i32)}
    return q, layer, rows, arrays


def test_splitk_matches_the_oracle_on_a_long_row_of_large_scores():
    """Scores from -300 to 300 across a 20000-key row (chunk maxima far apart, past exp's
    float32 range), a short row, and a row without pages (zeros)."""
    hkv, g, d, ps = 2, 4, 128, 16
    lens = [20000, 37, 0]
    q, layer, rows, arrays = _paged_rows(lens, hkv, g, d, ps, torch.Generator().manual_seed(0))
    w = S.SplitKDecode(None, hkv * g, hkv, d, ps)
    w.plan(arrays["paged_kv_indptr"], arrays["paged_kv_indices"], arrays["paged_kv_last_page_len"], dtype=F32,
           kv_lens=arrays["kv_lens"])
    out = w.run(q, layer)
    assert out.dtype == F32 and out.shape == q.shape
    for r, (n, (k, v)) in enumerate(zip(lens, rows, strict=True)):
        if n == 0:
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        ref = attention_oracle(q[r:r + 1], k, v)
        err = rel_error(out[r:r + 1], ref)
        assert err <= numerics.tolerance(2e-5, F32, n, numerics.REACH + 10.0, d), (r, err)
    s = torch.einsum("hd,khd->hk", q[0].double(), rows[0][0].double().repeat_interleave(g, 1)) / math.sqrt(d)
    assert s.max() > 250 and s.min() < -250  # the row's scores do span the range


def test_the_clean_splitk_passes_the_quick_check(splitk):
    report = K.check_backend(CLEAN, "cpu", registry=splitk, quick=True)
    assert report.ok, report.render(all_rows=False)
    assert {r.dtype for r in report.results} == {"float32", "float16", "bfloat16"}
    assert {"plain", "shapes", "edge", "numerics", "replan", "layers"} <= {r.group for r in report.results}


def test_the_clean_splitk_passes_numerics_and_edge_at_head_dim_256(splitk):
    """The default (not quick) numerics cases, rows of 32768 keys among them, in every dtype."""
    report = K.check_backend(CLEAN, "cpu", registry=splitk, groups=["numerics", "edge"], head_dims=[256])
    assert report.ok, report.render(all_rows=False)
    assert any("-d256-" in r.name and "-p32767_" in r.name for r in report.results)
    assert {r.dtype for r in report.results} == {"float32", "float16", "bfloat16"}


# -- each slip, failed by the kit ----------------------------------------------------------------


@pytest.mark.parametrize("slip", sorted(SLIPS))
def test_each_splitk_slip_fails_naming_its_rule(splitk, slip):
    _, selection, rule, group, case, says = SLIPS[slip]
    report = K.check_backend(slip, "cpu", registry=splitk, quick=True, **selection)
    text = report.render(all_rows=False)
    assert not report.ok, text
    assert {r.rule for r in report.failed} == {rule}, text
    assert {r.group for r in report.failed} == {group}, text
    assert any(case in r.name and says in r.message for r in report.failed), text
    for r in report.failed:
        assert f"rule {rule}: " in r.message and r.error is not None and r.error > 0, r


@pytest.mark.parametrize("chunk", [64, 256, 1000, 4096])
def test_a_merge_against_the_last_chunks_max_fails_whatever_the_chunk(splitk, monkeypatch, chunk):
    # rows whose maximum sits at one end and only low scores at the other, so no chunking hides it
    monkeypatch.setattr(S, "CHUNK", chunk)
    assert K.check_backend(CLEAN, "cpu", registry=splitk, quick=True, groups=["numerics"], dtypes=[F32]).ok
    report = K.check_backend("merge_last_chunk_max", "cpu", registry=splitk, quick=True, groups=["numerics"],
                             dtypes=[F32])
    assert not report.ok and {r.rule for r in report.failed} == {"oracle"}, report.render(all_rows=False)


def test_the_fp16_fast_path_shows_only_where_float16_is_checked(splitk):
    report = K.check_backend("fp16_exp_without_max", "cpu", registry=splitk, quick=True, groups=["numerics"],
                             dtypes=[F32, BF16])
    assert report.ok, report.render(all_rows=False)


def test_the_first_128_dims_slip_shows_only_at_head_dim_256(splitk):
    report = K.check_backend("first_128_dims", "cpu", registry=splitk, groups=["plain", "numerics"], dtypes=[F32],
                             head_dims=[64, 128])
    assert report.ok, report.render(all_rows=False)


def test_bf16_accumulators_in_a_bf16_check_show_on_the_long_row(splitk):
    """Checked in bfloat16 (tolerance 1.6e-2), accumulation in bfloat16 errs past it only where it
    stalls: on the long row of unit-scale scores (8192 keys under --quick)."""
    report = K.check_backend("bf16_accumulators", "cpu", registry=splitk, quick=True, groups=["numerics"],
                             dtypes=[BF16])
    assert {r.rule for r in report.failed} == {"oracle"}, report.render(all_rows=False)
    assert [r.name for r in report.failed] == ["ps64-d64-gqa4-kv1-causal-q1_1_1-p8191_3000_10"]
    assert "row 0 (1 queries, 8192 keys)" in report.failed[0].message


# -- a kv_indptr that does not start at 0: refused before any wrapper sees it ---------------------


def test_a_kv_indptr_not_from_zero_is_refused_by_the_core():
    """A kernel that takes ``kv_indptr[0]`` for 0 is never handed one that is not: the core's plan
    builder refuses it, naming the rule, and so does the wrapper's plan (it builds the same plan)."""
    i32 = torch.int32
    indptr = torch.tensor([1, 2, 4], dtype=i32)  # two rows, their pages from entry 1 of indices
    indices, last = torch.arange(4, dtype=i32), torch.tensor([16, 5], dtype=i32)
    with pytest.raises(InputError, match=r"kv_indptr must start at 0, got kv_indptr\[0\] = 1"):
        paged_plan("paged_decode", None, indptr, indices, last, 16, F32)
    w = S.SplitKDecode(None, 8, 2, 64, 16)
    with pytest.raises(ValueError, match=r"must start at 0"):
        w.plan(indptr, indices, last, dtype=F32)
