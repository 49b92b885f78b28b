"""What the kit's reuse checks build: the head dim their step sequences and checks default to, and
the size a ragged wrapper is built with (no pages: page size 0, as WrapperSize documents)."""

from __future__ import annotations

import pytest

from mstar_core.attention.plans import WrapperSize
from mstar_core.backends.reference.dense import ReferencePrefixedPrefillWrapper
from mstar_core.backends.reference.paged import ReferenceDecodeWrapper
from mstar_core.testing import reuse
from mstar_core.testing.conformance import WrapperSet


@pytest.mark.parametrize("kind", sorted(reuse.STEPS))
def test_the_step_sequences_default_to_head_dim_128(kind):
    assert {c.head_dim for c in reuse.steps(kind)} == {128}
    if kind != "ragged":
        assert {c.head_dim for c in reuse.paged_steps(kind)} == {128}


@pytest.mark.parametrize("check", [reuse.check_replan, reuse.check_layers, reuse.check_refused])
def test_the_reuse_checks_default_to_head_dim_128(check):
    built: list[int] = []

    class Spy(ReferenceDecodeWrapper):
        @classmethod
        def from_size(cls, size: WrapperSize) -> ReferenceDecodeWrapper:
            built.append(size.head_dim)
            return super().from_size(size)

    check(WrapperSet("spy", decode=Spy), "decode")
    assert set(built) == {128}


def test_a_ragged_wrapper_is_built_with_no_pages():
    built: list[WrapperSize] = []

    class Spy(ReferencePrefixedPrefillWrapper):
        @classmethod
        def from_size(cls, size: WrapperSize) -> ReferencePrefixedPrefillWrapper:
            built.append(size)
            return super().from_size(size)

    reuse.check_replan(WrapperSet("spy", ragged=Spy), "ragged", head_dim=64)
    assert [s.page_size for s in built] == [0]


@pytest.mark.parametrize(("kind", "tokens"), [("prefill", reuse.TOKENS), ("decode", None)])
def test_a_graph_mode_wrapper_is_sized_for_every_step_and_prefill_for_its_tokens(kind, tokens):
    built: list[WrapperSize] = []

    class Spy:
        @classmethod
        def from_size(cls, size: WrapperSize) -> Spy:
            built.append(size)
            return cls()

    reuse._wrapper(WrapperSet("spy", **{kind: Spy}), kind, 64, graph=True)
    (size,) = built
    assert (size.batch_size, size.max_num_pages, size.accelerator_graph) == (reuse.BATCH, reuse.PAGES, True)
    assert size.max_total_tokens == tokens
