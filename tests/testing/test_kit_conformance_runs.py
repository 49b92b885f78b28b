"""How the conformance module runs one case: which row a token belongs to, each row's error and
tolerance, the index arrays and run keywords a backend gets, the sizes its wrappers are built
with, the plans they get, and the ragged data a case draws."""

from __future__ import annotations

import math

import pytest
import torch

from mstar_core.backends.reference import dense as RD
from mstar_core.backends.reference import paged as RP
from mstar_core.testing import conformance as C
from mstar_core.testing import numerics

from . import rule_breakers as B


def _spy(base: type) -> type:
    """A reference wrapper class that records the sizes it is built with and the plans it gets."""

    class Spy(base):
        sizes: list = []
        plans: list = []

        @classmethod
        def from_size(cls, size):
            cls.sizes.append(size)
            return super().from_size(size)

        def plan(self, *args, **kwargs):
            type(self).plans.append((args, kwargs))
            return super().plan(*args, **kwargs)

    Spy.sizes, Spy.plans = [], []
    return Spy


@pytest.mark.parametrize(("token", "row"), [(0, 0), (1, 0), (2, 1), (4, 1), (5, 2), (6, 2), (9, 2)])
def test_a_token_belongs_to_the_row_whose_queries_hold_it(token, row):
    # rows of 2, 3 and 1 queries: tokens 0-1, 2-4, 5; a token past the last is the last row's
    assert C._row_of(C.RaggedCase(64, 1, (2, 3, 1), (0, 0, 0)), token) == row


def test_row_errors_are_each_rows_relative_error_over_its_kept_queries():
    case = C.RaggedCase(8, 1, (2, 3, 1), (0, 0, 0))
    gen = torch.Generator().manual_seed(5)
    ref = torch.randn((6, 2, 8), generator=gen, dtype=torch.float64)
    out = ref + 0.1 * torch.randn((6, 2, 8), generator=gen, dtype=torch.float64)
    keep = torch.tensor([True, False, True, True, False, False])
    want = [(out[r] - ref[r]).norm().item() / ref[r].norm().item() for r in ([0], [2, 3])] + [0.0]
    assert C.row_errors(case, out, ref, keep) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(("scores", "reach"), [("", 0.0), ("hundreds", numerics.REACH + 10.0)])
def test_row_tolerances_grow_with_each_rows_keys_and_the_shaped_scores_reach(scores, reach):
    case = C.RaggedCase(64, 1, (2, 3), (5, 40), scores=scores)
    base, unit = C.TOLERANCE[torch.bfloat16], 2.0 ** -24
    want = [base + (n + reach * 8.0) * unit for n in (7, 43)]
    assert C.row_tolerances(case, torch.bfloat16) == pytest.approx(want, rel=1e-12)
    assert numerics.REACH + 10.0 == 310.0  # the shaped scores' largest, noise included


class _CopiedIndices(C.WrapperSet):
    def indices(self, data):
        return data.kv_indices.clone()  # stands for the device copy a GPU backend gets


@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_paged_arrays_give_decode_no_qo_indptr_and_mixed_its_page_indices_on_the_host(kind):
    case = C.PagedCase(4, 64, 1, (1, 1), (3, 6))
    data = C.make_paged(case, "cpu", torch.float32)
    arrays = C.paged_arrays(_CopiedIndices("x"), kind, data)
    assert ("qo_indptr" in arrays) is (kind != "decode")
    assert (arrays["paged_kv_indices"] is data.kv_indices) is (kind == "mixed")
    assert arrays["paged_kv_indptr"] is data.kv_indptr and arrays["kv_lens"] is data.kv_lens
    assert arrays["paged_kv_last_page_len"] is data.last_page_len


def test_run_keywords_name_only_the_cases_features():
    plain = C.PagedCase(16, 64, 1, (1,), (3,))
    assert C._run_kwargs(plain, None) == {}
    sinks = torch.zeros(2)
    kw = C._run_kwargs(C.PagedCase(16, 64, 1, (1,), (3,), kv_dtype="fp8_e4m3", sinks=True), sinks)
    assert kw.keys() == {"k_scale", "v_scale", "sinks"} and kw["sinks"] is sinks
    assert (kw["k_scale"], kw["v_scale"]) == (C.K_SCALE, C.V_SCALE)


def test_a_mixed_wrapper_is_sized_for_the_cases_rows_tokens_pages_and_prompt_rows():
    spy = _spy(RP.ReferenceMixedWrapper)
    case = C.PagedCase(4, 64, 3, (1, 5, 1, 2), (3, 0, 9, 1), num_kv_heads=2)
    data = C.make_paged(case, "cpu", torch.float32)
    C.build(C.WrapperSet("x", mixed=spy, workspace_bytes=4096), "mixed", case, data)
    (size,) = spy.sizes
    assert (size.num_qo_heads, size.num_kv_heads, size.head_dim, size.page_size) == (6, 2, 64, 4)
    assert (size.batch_size, size.max_total_tokens, size.max_num_pages) == (4, 9, data.layer.shape[0])
    assert size.max_prefill_rows == 2 and size.workspace_bytes == 4096


def test_a_mixed_wrapper_for_decode_rows_only_still_takes_one_prompt_row():
    spy = _spy(RP.ReferenceMixedWrapper)
    case = C.PagedCase(4, 64, 1, (1, 1), (3, 6))
    C.build(C.WrapperSet("x", mixed=spy), "mixed", case, C.make_paged(case, "cpu", torch.float32))
    assert spy.sizes[0].max_prefill_rows == 1


def test_a_wrapper_is_built_on_the_device_asked_for_else_the_backends():
    spy = _spy(RP.ReferencePrefillWrapper)
    case = C.PagedCase(4, 64, 1, (2,), (3,))
    C.build(C.WrapperSet("x", prefill=spy, device="meta"), "prefill", case, device="cpu")
    C.build(C.WrapperSet("x", prefill=spy, device="cpu"), "prefill", case)
    assert [s.device for s in spy.sizes] == [torch.device("cpu")] * 2
    ragged = _spy(RD.ReferencePrefixedPrefillWrapper)
    C.build(C.WrapperSet("x", ragged=ragged), "ragged", C.RaggedCase(64, 4, (2,), (3,)))
    assert (ragged.sizes[0].num_qo_heads, ragged.sizes[0].page_size) == (8, 0)


def test_check_mixed_builds_with_the_prompt_rows_asked_for():
    spy = _spy(RP.ReferenceMixedWrapper)
    case = C.PagedCase(4, 64, 2, (1, 5, 1), (3, 0, 9))
    C.check_mixed(C.WrapperSet("x", mixed=spy), case, max_prefill_rows=3)
    (size,) = spy.sizes
    assert (size.max_prefill_rows, size.num_qo_heads, size.batch_size, size.max_total_tokens) == (3, 4, 3, 7)
    assert size.max_num_pages == C.make_paged(case, "cpu", torch.float32, stale_nan=True).layer.shape[0]


def test_check_mixed_sizes_a_wrapper_for_the_cases_prompt_rows_by_default():
    spy = _spy(RP.ReferenceMixedWrapper)
    assert C.check_mixed(C.WrapperSet("x", mixed=spy), C.PagedCase(4, 64, 2, (1, 5, 3), (3, 0, 9))) < 1e-5
    assert spy.sizes[0].max_prefill_rows == 2


def test_check_mixed_plans_a_wrapper_given_rather_than_building_one():
    spy = _spy(RP.ReferenceMixedWrapper)
    case = C.PagedCase(4, 64, 1, (1, 5), (3, 0))
    w = RP.ReferenceMixedWrapper(None, None, 2, 2, 64, 4, 2, 6, 8, 1, "cpu")
    C.check_mixed(C.WrapperSet("x", mixed=spy), case, max_prefill_rows=1, wrapper=w)
    assert spy.sizes == []


def test_a_decode_plan_is_causal_with_the_rows_query_count():
    case = C.PagedCase(4, 64, 1, (2, 2), (3, 6), causal=False)
    data = C.make_paged(case, "cpu", torch.float32)
    plan = C.make_plan(C.WrapperSet("x"), "decode", case, data)
    assert (plan.causal, plan.query_tokens) == (True, 2)
    prefill = C.make_plan(C.WrapperSet("x"), "prefill", case, data)
    assert (prefill.causal, prefill.query_tokens) == (False, 1)
    one = C.PagedCase(4, 64, 1, (3,), (2,))
    assert C.make_plan(C.WrapperSet("x"), "decode", one, C.make_paged(one, "cpu", torch.float32)).query_tokens == 3
    empty = C.PagedCase(4, 64, 1, (), ())  # a step with no rows: one query a row, as for any decode
    assert C.make_plan(C.WrapperSet("x"), "decode", empty, C.make_paged(empty, "cpu", torch.float32)).query_tokens == 1


def test_a_paged_plan_is_built_from_the_arrays_given():
    case = C.PagedCase(4, 64, 1, (1, 1), (3, 6))
    data = C.make_paged(case, "cpu", torch.float32)
    arrays = C.paged_arrays(C.WrapperSet("x"), "prefill", data)
    arrays["kv_lens"] = arrays["kv_lens"].clone()
    assert C.make_plan(C.WrapperSet("x"), "prefill", case, data, arrays).kv_lens is arrays["kv_lens"]


def test_plan_paged_passes_the_backends_and_the_callers_plan_keywords():
    spy = _spy(RP.ReferencePrefillWrapper)
    case = C.PagedCase(4, 64, 1, (2,), (3,))
    data = C.make_paged(case, "cpu", torch.float32)
    w = spy(None, 1, 1, 64, 4)
    ws = C.WrapperSet("x", prefill=spy, api_version="1.1", extra_plan_kwargs={"logits_soft_cap": None})
    C.plan_paged(ws, "prefill", case, data, w, extra={"sm_scale": None})
    (_, kw), = spy.plans
    assert {"logits_soft_cap", "sm_scale"} <= kw.keys()


def test_a_ragged_case_draws_its_rows_keys_after_their_prefixes_and_poisons_one_row():
    case = C.RaggedCase(8, 2, (2, 3), (4, 1), num_kv_heads=1, poison_row=1)
    data = C.make_ragged(case, "cpu", torch.float32)
    assert data.cu_q.tolist() == [0, 2, 5] and data.cu_k.tolist() == [0, 6, 10]
    assert tuple(data.q.shape) == (5, 2, 8) and tuple(data.k.shape) == tuple(data.v.shape) == (10, 1, 8)
    assert data.q[2:].isnan().all() and data.k[6:].isinf().all() and data.v[6:].isnan().all()
    assert data.q[:2].isfinite().all() and data.k[:6].isfinite().all() and data.v[:6].isfinite().all()
    clean = C.make_ragged(C.RaggedCase(8, 2, (2, 3), (4, 1), num_kv_heads=1), "cpu", torch.float32)
    assert torch.equal(data.ref, clean.ref) and data.ref.isfinite().all()
    # the oracle, row by row on the clean data (row 1: 3 queries on its 4 keys, causal)
    for r in range(2):
        qs, ks = slice(*clean.cu_q[r:r + 2].tolist()), slice(*clean.cu_k[r:r + 2].tolist())
        want = C.attention_oracle(clean.q[qs].double(), clean.k[ks].double(), clean.v[ks].double(), True, -1, None,
                                  None, None)
        assert torch.allclose(clean.ref[qs], want, rtol=0, atol=1e-12)


def test_a_ragged_layer_draws_values_of_its_own():
    first = C.make_ragged(C.RaggedCase(8, 1, (2,), (1,), seed=3), "cpu", torch.float32)
    other = C.make_ragged(C.RaggedCase(8, 1, (2,), (1,), seed=3, layer=1), "cpu", torch.float32)
    assert not torch.equal(first.q, other.q)


def test_a_ragged_plan_bounds_its_rows_by_the_longest_queries_and_keys():
    case = C.RaggedCase(8, 1, (2, 5, 1), (7, 0, 2))
    plan = C.make_ragged_plan(case, C.make_ragged(case, "cpu", torch.float32))
    assert (plan.max_q, plan.max_k) == (5, 9)


@pytest.mark.parametrize(("api_version", "takes_object"), [(None, True), ("1.1", False), ("2.0", True)])
def test_plan_ragged_speaks_the_version_asked_for_else_the_wrappers(api_version, takes_object):
    spy = _spy(RD.ReferencePrefixedPrefillWrapper)
    case = C.RaggedCase(8, 1, (2,), (1,))
    C.plan_ragged(case, C.make_ragged(case, "cpu", torch.float32), spy(2, 2, 8), api_version=api_version)
    (args, _), = spy.plans
    assert (len(args) == 1) is takes_object


def test_a_ragged_run_plans_its_wrapper_and_matches_the_oracle():
    spy = _spy(RD.ReferencePrefixedPrefillWrapper)
    case = C.RaggedCase(8, 2, (2, 3), (4, 1), sinks=True)
    ran = C.run_ragged(C.WrapperSet("x", ragged=spy, api_version="1.1"), case)
    assert len(spy.plans) == 1 and len(spy.sizes) == 0  # 1.1: built from its arguments
    assert ran.error < C.TOLERANCE[torch.float32] and math.isfinite(ran.error)


def _close(case, out, ref, dtype=torch.float32) -> C.RuleError | float:
    try:
        return C.assert_close(C.WrapperSet("x", dtype=dtype), "prefill", case, out, ref)
    except C.RuleError as e:
        return e


def _rows(q_lens, value=1.0):
    return torch.full((sum(q_lens), 1, 2), value, dtype=torch.float64)


def test_assert_close_returns_the_largest_rows_error():
    case = C.RaggedCase(2, 1, (1, 1), (1, 1))
    ref = _rows((1, 1))
    out = ref.clone()
    out[0, 0, 0], out[1, 0, 0] = 1 + 2e-6, 1 + 8e-6
    assert _close(case, out.float(), ref) == pytest.approx(8e-6 / math.sqrt(2), rel=1e-2)


def test_an_error_equal_to_the_tolerance_passes():
    case = C.RaggedCase(2, 1, (1,), (3,))
    tol = C.row_tolerances(case, torch.float64)[0]
    out = torch.zeros((1, 1, 2), dtype=torch.float64)
    out[0, 0, 0] = tol  # against zeros the relative error is the output's norm: tol exactly
    assert _close(case, out, torch.zeros_like(out), torch.float64) == tol
    out[0, 0, 0] = tol * (1 + 1e-9)
    assert isinstance(_close(case, out, torch.zeros_like(out), torch.float64), C.RuleError)


def test_the_failure_names_the_row_furthest_past_its_tolerance_and_the_largest_error():
    # row 1's ten million keys give it a tolerance near 0.6: its error of 1 is further past in
    # absolute terms, row 0's 0.05 (against 0.016) further past relatively
    case = C.RaggedCase(2, 1, (1, 1), (0, 10_000_000))
    ref = _rows((1, 1))
    out = ref.clone()
    out[0, 0, 0] = 1 + 0.05 * math.sqrt(2)
    out[1] = 0.0
    e = _close(case, out.to(torch.bfloat16), ref, torch.bfloat16)
    assert isinstance(e, C.RuleError) and e.rule == "oracle"
    assert e.detail.startswith("row 0 (1 queries, 1 keys)")
    assert "largest error 1 at " in e.detail and "(row 1)" in e.detail


def test_a_poisoned_rows_output_is_left_out_of_errors_and_the_worst_spot():
    case = C.RaggedCase(2, 1, (1, 1, 1), (1, 1, 1), poison_row=1)
    ref = _rows((1, 1, 1))
    out = ref.clone()
    out[1] = 1e6
    assert _close(case, out.float(), ref) == 0.0
    out[2, 0, 0] = 1.5
    e = _close(case, out.float(), ref)
    assert isinstance(e, C.RuleError) and e.rule == "oracle" and "(row 2)" in e.detail


def test_wrong_queries_that_see_no_key_fail_the_no_key_rule_only_where_the_rest_is_right():
    # row 0's first query sees no key (it must return zeros); row 2 is poisoned
    case = C.RaggedCase(2, 1, (2, 1, 1), (-1, 1, 1), poison_row=2)
    ref = _rows((2, 1, 1))
    ref[0] = 0.0
    out = ref.clone()
    out[0] = 1.0
    out[3] = float("nan")
    e = _close(case, out.float(), ref)
    assert isinstance(e, C.RuleError) and e.rule == "no-key"
    out[2, 0, 0] = 2.0  # a row that sees keys wrong too: the oracle
    e = _close(case, out.float(), ref)
    assert isinstance(e, C.RuleError) and e.rule == "oracle"


def test_nan_in_a_clean_row_names_isolation_stale_slots_or_the_oracle():
    ref = _rows((1, 1))
    out = ref.clone()
    out[0, 0, 0] = float("nan")
    rules = [_close(c, out.float(), ref).rule for c in (
        C.RaggedCase(2, 1, (1, 1), (1, 1), poison_row=1), C.PagedCase(4, 2, 1, (1, 1), (1, 1)),
        C.RaggedCase(2, 1, (1, 1), (1, 1)))]
    assert rules == ["isolation", "stale-slots", "oracle"]


def test_assert_close_fails_a_non_tensor_a_wrong_shape_dtype_or_device():
    case = C.RaggedCase(2, 1, (1, 1), (1, 1))
    ref = _rows((1, 1))
    out = ref.float()
    assert _close(case, None, ref).rule == "shape"
    assert _close(case, out[:, :, :1], ref).rule == "shape"
    assert _close(case, ref, ref).rule == "dtype"
    with pytest.raises(C.RuleError) as e:
        C.assert_close(C.WrapperSet("x"), "prefill", case, out, ref, q=torch.empty((2, 1, 2), device="meta"))
    assert e.value.rule == "device"


def test_wrong_queries_that_see_no_key_fail_no_key_with_the_rest_just_within_tolerance():
    # row 0's first query sees no key; its second errs by its tolerance exactly (against zeros)
    case = C.RaggedCase(2, 1, (2,), (-1,))
    tol = C.row_tolerances(case, torch.float64)[0]
    ref = torch.zeros((2, 1, 2), dtype=torch.float64)
    out = ref.clone()
    out[0], out[1, 0, 0] = 1.0, tol
    assert _close(case, out, ref, torch.float64).rule == "no-key"


def _ragged_run(outputs: list, ref: torch.Tensor, thorough: bool = True, case=None):
    """exercise() on a ragged case whose run returns ``outputs`` in turn (a callable: called with q)."""
    case = case or C.RaggedCase(2, 1, (1, 1), (1, 1))
    q = torch.ones((2, 1, 2))
    view, base = C.fused_view(q, 0, 2, 8)
    calls: list = []

    def run(q):
        calls.append(q)
        o = outputs[len(calls) - 1]
        return o(q) if callable(o) else o

    ran = C.exercise(C.WrapperSet("x", thorough=thorough), "ragged", case, run, {"q": q}, {"q": (view, base)}, {},
                     C.snapshot({"q": q}), ref)
    return ran, calls


def test_exercise_runs_once_unless_thorough_and_returns_the_first_output_and_its_copy():
    ref = _rows((1, 1))
    out = ref.float()
    ran, calls = _ragged_run([out], ref, thorough=False)
    assert len(calls) == 1 and ran.out is out and torch.equal(ran.value, out) and ran.value is not out
    ran, calls = _ragged_run([out, out.clone(), out.clone()], ref)
    assert len(calls) == 3 and not calls[2].is_contiguous()


@pytest.mark.parametrize("again", [None, "shape", "value"])
def test_a_second_run_that_differs_fails_deterministic(again):
    ref = _rows((1, 1))
    out = ref.float()
    second = {None: None, "shape": out[:1].clone(), "value": out + 1e-7}[again]
    with pytest.raises(C.RuleError) as e:
        _ragged_run([out, second, out.clone()], ref)
    assert e.value.rule == "deterministic"
    assert e.value.error == (pytest.approx(1e-7, rel=0.2) if again == "value" else float("inf"))


def test_a_run_that_writes_its_inputs_fails_inputs_unchanged_after_the_run_that_wrote():
    ref = _rows((1, 1))
    out = ref.float()

    def writes(q):
        q.add_(1.0)
        return out.clone()

    def undoes(q):
        q.sub_(1.0)
        return out.clone()

    for outputs in ([writes, undoes, out.clone()], [out, writes, out.clone()]):
        with pytest.raises(C.RuleError) as e:
            _ragged_run(outputs, ref)
        assert e.value.rule == "inputs-unchanged"


def test_a_run_on_strided_views_is_checked_against_the_oracle_and_for_writes_to_the_buffer():
    ref = _rows((1, 1))
    out = ref.float()
    with pytest.raises(C.RuleError) as e:
        _ragged_run([out, out.clone(), out + 1.0], ref)
    assert e.value.rule == "strided-inputs"

    def writes_buffer(q):
        q._base.view(-1)[0] += 1.0  # a slot of the fused buffer outside the view
        return out.clone()

    with pytest.raises(C.RuleError) as e:
        _ragged_run([out, out.clone(), writes_buffer], ref)
    assert e.value.rule == "inputs-unchanged"


def test_a_later_run_that_changes_the_first_output_fails_owned_output():
    ref = _rows((1, 1))
    out = ref.float()

    def overwrites(q):
        out.add_(1e-3)
        return ref.float()

    with pytest.raises(C.RuleError) as e:
        _ragged_run([out, out.clone(), overwrites], ref)
    assert e.value.rule == "owned-output"


class _NaNDecode(RP.ReferenceDecodeWrapper):
    def run(self, q, kv_cache_layer, **kwargs):
        return torch.full_like(super().run(q, kv_cache_layer, **kwargs), float("nan"))


class _NaNDecodeWidened(RP.ReferenceDecodeWrapper):
    def run(self, q, kv_cache_layer, **kwargs):
        return torch.full_like(super().run(q, kv_cache_layer, **kwargs), float("nan"), dtype=torch.float64)


class _NaNThenNothing(RP.ReferenceDecodeWrapper):
    def run(self, q, kv_cache_layer, **kwargs):
        if getattr(self, "ran", False):
            return None
        self.ran = True
        return torch.full_like(super().run(q, kv_cache_layer, **kwargs), float("nan"))


@pytest.mark.parametrize(("decode", "rule"), [
    (B.DecodeOneSlotPast, "stale-slots"),  # NaN from a stale slot: gone with the slots zeroed
    (_NaNDecode, "oracle"),  # NaN with the slots zeroed too: its own arithmetic
    (_NaNDecodeWidened, "dtype"),  # another rule first: named as it is
    (_NaNThenNothing, "stale-slots"),  # no tensor from the run with the slots zeroed
])
def test_nan_in_a_decode_row_names_stale_slots_only_where_zeroing_them_clears_it(decode, rule):
    with pytest.raises(C.RuleError) as e:
        C.check_decode(C.WrapperSet("x", decode=decode, api_version="1.1"), C.PagedCase(16, 64, 1, (1, 1), (4, 20)))
    assert e.value.rule == rule


def test_the_oracle_is_causal_for_decode_rows_and_as_the_case_says_for_prefill():
    assert C.check_decode(C.WrapperSet("x", decode=RP.ReferenceDecodeWrapper),
                          C.PagedCase(4, 64, 1, (3, 3), (2, 5))) < 1e-5
    assert C.check_prefill(C.WrapperSet("x", prefill=RP.ReferencePrefillWrapper),
                           C.PagedCase(4, 64, 1, (3, 3), (2, 5), causal=False)) < 1e-5


def test_a_paged_poisoned_case_keeps_its_stale_slots_clean_and_other_cases_fill_them_with_nan():
    # a wrapper reading one slot past each row fails a poisoned case only through the oracle
    case = C.PagedCase(16, 64, 1, (1, 1, 1), (4, 20, 7), poison_row=1)
    with pytest.raises(C.RuleError) as e:
        C.check_decode(C.WrapperSet("x", decode=B.DecodeOneSlotPast, api_version="1.1"), case)
    assert e.value.rule == "oracle"


def test_shaped_scores_aim_a_high_rows_queries_at_its_keys():
    # "hundreds": row 0 falls, row 1's scores are all high (150 to 300)
    case = C.RaggedCase(16, 1, (2, 2), (6, 6), num_kv_heads=1, scores="hundreds")
    data = C.make_ragged(case, "cpu", torch.float32)
    scores = data.q[2:, 0].double() @ data.k[8:, 0].double().T / 4.0
    assert scores.min() > 100


class _DecodeClearsSinks(RP.ReferenceDecodeWrapper):
    def run(self, q, kv_cache_layer, *, sinks=None, **kwargs):
        out = super().run(q, kv_cache_layer, sinks=sinks, **kwargs)
        sinks.zero_()
        return out


class _RaggedClearsSinks(RD.ReferencePrefixedPrefillWrapper):
    def run(self, q, k, v, *, sinks=None):
        out = super().run(q, k, v, sinks=sinks)
        sinks.zero_()
        return out


def test_a_run_that_writes_the_sink_logits_fails_inputs_unchanged():
    with pytest.raises(C.RuleError) as e:
        C.check_decode(C.WrapperSet("x", decode=_DecodeClearsSinks), C.PagedCase(4, 64, 2, (1, 1), (3, 6), sinks=True))
    assert e.value.rule == "inputs-unchanged"
    with pytest.raises(C.RuleError) as e:
        C.check_ragged(C.WrapperSet("x", ragged=_RaggedClearsSinks), C.RaggedCase(64, 2, (2, 1), (3, 6), sinks=True))
    assert e.value.rule == "inputs-unchanged"


def test_a_ragged_run_plans_a_wrapper_given_rather_than_building_one():
    spy = _spy(RD.ReferencePrefixedPrefillWrapper)
    case = C.RaggedCase(8, 2, (2, 3), (4, 1))
    C.run_ragged(C.WrapperSet("x", ragged=spy), case, wrapper=spy(4, 2, 8))
    assert spy.sizes == [] and len(spy.plans) == 1
