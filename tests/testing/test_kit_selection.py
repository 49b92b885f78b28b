"""Which cases, head dims and dtypes ``mstar check`` picks and refuses (docs/PLUGINS.md, "Testing"):
the ``--quick`` subset of the plain cases, a case moved to the nearest checked head dim, what a
run names as left out, the arguments it refuses, and the summary's count of failures by rule."""

from __future__ import annotations

import pytest
import torch

from mstar_core.backends import reference as R
from mstar_core.errors import InputError
from mstar_core.registry.spec import BackendSpec, CapabilitySpec, HeadDims
from mstar_core.testing import check as K
from mstar_core.testing import conformance as C

F32, BF16 = torch.float32, torch.bfloat16
DECODE = "mstar_core.backends.reference:ReferenceDecodeWrapper"
PREFILL = "mstar_core.backends.reference:ReferencePrefixedPrefillWrapper"
CLASSES = {"paged_decode": R.ReferenceDecodeWrapper}


def _spec(dims: HeadDims, dtypes=(F32,), per_capability=None) -> BackendSpec:
    provides = {"paged_decode": DECODE}
    if per_capability:
        provides["paged_prefill"] = PREFILL
    return BackendSpec(name="sel", provides=provides, devices=("cpu",), dtypes=dtypes, head_dims=dims,
                       api_version="1.1", per_capability=per_capability or {})


def _rows(q_lens, **kw) -> C.RaggedCase:
    return C.RaggedCase(64, 4, tuple(q_lens), (0,) * len(q_lens), **kw)


@pytest.mark.parametrize(("case", "targeted"), [
    (_rows((1, 7)), False),
    (_rows((1, 7), window_left=0), True),  # a window of 0 keys is a window
    (_rows((1, 7), sm_scale=0.5), True),
    (_rows((1, 7), causal=False), True),
    (_rows((2, 2)), True),  # uniform rows of more than one query
    (_rows((1, 1)), False),  # uniform one-query rows are plain decode rows
    (_rows((4,)), False),  # one row is not "uniform rows"
    (_rows((3, 7)), False),
    (_rows((64,)), False),
    (_rows((65,)), True),  # a long prompt
    (_rows((1, 65)), True),
])
def test_a_case_is_targeted_by_a_window_a_scale_no_mask_uniform_rows_or_a_long_prompt(case, targeted):
    assert K._targeted(case) is targeted


def _grid(page_size: int, gqa: int, causal: bool = True, q_lens=(1, 7)) -> C.PagedCase:
    return C.PagedCase(page_size, 64, gqa, q_lens, (0,) * len(q_lens), causal=causal)


def test_quick_keeps_the_targeted_cases_and_one_causal_gqa4_case_per_page_size():
    cases = [_grid(1, 1), _grid(1, 4), _grid(1, 4, q_lens=(3, 7)), _grid(1, 8),
             _grid(16, 8), _grid(16, 4, causal=False), _grid(16, 4),
             _grid(32, 5), _grid(32, 4, q_lens=(2, 2)), _grid(32, 4)]
    kept = [cases[1], cases[5], cases[8]]  # a targeted case stands for its page size too
    assert K._quick_plain(cases) == kept


def test_a_case_moves_to_the_nearest_checked_head_dim_once():
    at = [_rows((1, 7)), C.RaggedCase(128, 4, (1, 7), (0, 0)), C.RaggedCase(160, 4, (1, 7), (0, 0))]
    assert [c.head_dim for c in K._at(at, (64, 160))] == [64, 160]  # 128 is nearer 160 than 64
    assert [c.head_dim for c in K._at(at, (32, 80))] == [80]
    assert [c.head_dim for c in K._at(at[:1], (32, 256))] == [32]


def test_a_capability_s_cases_default_to_a_full_run_without_a_window():
    groups = K._cases("decode", (), (64,))
    assert "window" not in {g for g, _ in groups}
    plain = [c for g, c in groups if g == "plain"]
    assert plain == K._at(C.decode_cases(), (64,)) and len(plain) > len(K._quick_plain(C.decode_cases()))


def test_two_listed_head_dims_under_quick_leave_the_second_out():
    spec = _spec(HeadDims(values=(64, 96)))
    assert K.left_out(spec, CLASSES, None, None, True) == {
        "paged_decode head dims": "96 declared, not checked: --quick checks the first head dim only"}
    # one head dim asked: --quick cuts nothing, the rest is left out for the asked one
    assert K.left_out(_spec(HeadDims(values=(64, 96, 128))), CLASSES, None, [96], True) == {
        "paged_decode head dims": "64, 128 declared, not checked: not asked (--head-dim)"}


@pytest.mark.parametrize("dims", [HeadDims(multiple_of=64, maximum=128), HeadDims(multiple_of=64, maximum=127),
                                  HeadDims(multiple_of=1, maximum=1)])
def test_a_range_checked_whole_leaves_nothing_out(dims):
    assert K.left_out(_spec(dims), CLASSES, None, None, False) == {}


def test_a_range_s_maximum_asked_away_is_left_out():
    assert K.left_out(_spec(HeadDims(multiple_of=64, maximum=128)), CLASSES, None, [64], False) == {
        "paged_decode head dims": "declares multiples of 64 up to 128; checked 64 only (not asked (--head-dim))"}


def test_a_capability_checked_at_no_head_dim_says_so():
    spec = _spec(HeadDims(multiple_of=13), per_capability={"paged_prefill": CapabilitySpec(head_dims=HeadDims(
        values=(64,)))})
    classes = {**CLASSES, "paged_prefill": R.ReferencePrefixedPrefillWrapper}
    assert K.left_out(spec, classes, None, None, False) == {
        "paged_decode head dims": "declares multiples of 13; checked none (the suite checks none it allows)"}


def test_a_head_dim_one_capability_declares_is_checked():
    spec = _spec(HeadDims(values=(64,)), per_capability={"paged_prefill": CapabilitySpec(head_dims=HeadDims(
        values=(128,)))})
    K.check_given(spec, None, [128])
    K.check_given(spec, None, [64])
    with pytest.raises(InputError, match="cannot check head_dim 96 is not supported"):
        K.check_given(spec, None, [96])


def test_one_capability_with_head_dims_to_check_is_enough():
    spec = _spec(HeadDims(multiple_of=13), per_capability={"paged_prefill": CapabilitySpec(head_dims=HeadDims())})
    K.check_given(spec, None, None)


@pytest.mark.parametrize(("dims", "dtypes", "head_dims", "said"), [
    (HeadDims(values=(64,)), [], None, "(dtypes [], head dims []); it declares dtypes ['float32'], head dims 64"),
    (HeadDims(values=(64,)), [F32], [], "(dtypes ['float32'], head dims []); it declares dtypes ['float32'], "
                                        "head dims 64"),
    (HeadDims(multiple_of=13), None, None, "(dtypes ['float32'], head dims []); it declares dtypes ['float32'], "
                                           "head dims multiples of 13"),
])
def test_nothing_to_check_is_refused_naming_what_is_declared(dims, dtypes, head_dims, said):
    with pytest.raises(InputError) as err:
        K.check_given(_spec(dims), dtypes, head_dims)
    assert str(err.value) == f"backend 'sel': no dtype or head dim to check {said}"


def test_the_summary_counts_every_failure_of_a_rule():
    results = [K.Result("mixed", "plain", "float32", n, False, 0.5, "off", rule=rule)
               for n, rule in [("a", None), ("b", None), ("c", "oracle"), ("d", "oracle"), ("e", None)]]
    text = K.Report("mine", "Mine 1.0", "2.0", "cpu", results, {}).render()
    assert text.endswith("0 of 5 cases passed; 5 failed, by rule: ? (3), oracle (2)")
