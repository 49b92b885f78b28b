"""The comparisons every rule of the kit rests on: bits equal, the largest difference and where
it is, NaN and infinity handling, and the inputs-unchanged check's report."""

import math

import pytest
import torch

from mstar_core.testing.rules import RuleError, bits_equal, check_unchanged, difference, largest, snapshot


def test_bits_equal_compares_bits_not_values():
    assert bits_equal(torch.tensor([0.5, -1.0]), torch.tensor([0.5, -1.0]))
    assert not bits_equal(torch.tensor([0.5]), torch.tensor([0.7]))  # both would round to 0 as ints
    assert not bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert bits_equal(torch.tensor([math.nan]), torch.tensor([math.nan]))
    assert bits_equal(torch.tensor([True, False]), torch.tensor([True, False]))
    assert not bits_equal(torch.tensor([True, False]), torch.tensor([True, True]))


def test_bits_equal_needs_the_same_shape_and_dtype():
    assert not bits_equal(torch.zeros(4), torch.zeros(2, 2))
    assert not bits_equal(torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.int32))


def test_largest_names_the_entry_and_its_index_in_every_dimension():
    d = torch.zeros(2, 3, 4)
    d[1, 2, 3] = 5.0
    d[0, 1, 0] = 4.0
    assert largest(d) == (5.0, (1, 2, 3))
    d[0, 2, 1] = math.nan  # NaN counts as inf
    assert largest(d) == (math.inf, (0, 2, 1))
    assert largest(torch.tensor([3.0])) == (3.0, (0,))
    assert largest(torch.zeros(0, 4)) == (0.0, ())


def test_difference_holds_equal_infinities_and_shared_nans_equal_and_any_other_nan_infinite():
    inf, nan = math.inf, math.nan
    a = torch.tensor([1.0, inf, nan, -inf, 2.0])
    assert difference(a, a.clone()) == (0.0, (0,))
    assert difference(torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0])) == (inf, (0,))
    assert difference(torch.tensor([1.0, 1.0]), torch.tensor([1.0, nan])) == (inf, (1,))
    assert difference(torch.tensor([inf, 0.0]), torch.tensor([-inf, 0.0])) == (inf, (0,))
    assert difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) == (0.5, (1,))


def test_an_input_changed_in_shape_or_in_place_is_reported_as_such():
    q = torch.ones(2, 3)
    inputs = {"q": q}
    before = snapshot(inputs)
    check_unchanged("here", inputs, before, "after run")  # untouched: passes
    q[1, 2] = 4.0
    with pytest.raises(RuleError, match=r"q changed: largest change 3 at index 0 1, index 1 2") as e:
        check_unchanged("here", inputs, before, "after run")
    assert e.value.rule == "inputs-unchanged" and e.value.error == 3.0
    inputs["q"] = torch.ones(6)
    with pytest.raises(RuleError, match=r"q changed shape from \(2, 3\) to \(6,\)") as e:
        check_unchanged("here", inputs, before, "after run")
    assert e.value.rule == "inputs-unchanged" and e.value.error == math.inf


def test_a_window_of_zero_keys_back_sees_only_the_querys_own_position():
    from mstar_core.testing.oracle import visible

    assert torch.equal(visible(3, 3, True, 0), torch.eye(3, dtype=torch.bool))
    assert torch.equal(visible(2, 4, False, 1), torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool))
    assert visible(3, 3, False, -1).all()


def test_the_oracle_is_causal_unless_told_otherwise():
    from mstar_core.testing.oracle import attention_oracle

    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    assert torch.equal(attention_oracle(q, k, v), attention_oracle(q, k, v, causal=True))
    assert not torch.allclose(attention_oracle(q, k, v), attention_oracle(q, k, v, causal=False))


def test_the_relative_error_against_a_zero_reference_is_the_absolute_one():
    from mstar_core.testing.oracle import rel_error

    assert rel_error(torch.tensor([3.0, 4.0]), torch.zeros(2, dtype=torch.float64)) == 5.0
    assert rel_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0], dtype=torch.float64)) == 1.0
    assert rel_error(torch.tensor([math.inf, 0.0]), torch.zeros(2, dtype=torch.float64)) == math.inf
