"""Uniform multi-token decode rows (speculative verification): every row 2..8 query
tokens, captured and replayed like one-token decode, pre-planned, against the no-cache forward."""

import pytest
import torch

from mstar_core import (
    AttentionFeatures,
    GraphRunner,
    KVSpan,
    KVStep,
    Step,
)
from mstar_core.backends import reference as R

from ..helpers import REF_WRAPPERS, multi_token_graph_node, verify_multi_token_decode


@pytest.mark.parametrize("t", [2, 4, 8])
def test_multi_token_decode_replays_and_matches_the_full_forward(t):
    model, kv, _, node, runner = multi_token_graph_node(t)
    runner.warmup()
    assert runner.enabled and kv._graph_bufs.shape[2] == 4 * t  # per-token buffers for bucket x tokens
    verify_multi_token_decode(model, node, runner, t)


def test_rows_of_another_length_run_eagerly():
    _, _, _, node, runner = multi_token_graph_node(4)
    runner.warmup()
    for r in "ab":
        node.ingest_request(r)
    runner.step(Step(KVStep((KVSpan("a", "text", 3), KVSpan("b", "text", 3)))), torch.arange(6))
    prep = runner.prepare(Step(KVStep((KVSpan("a", "text", 2), KVSpan("b", "text", 4)))))
    assert prep.graph is None  # not uniform 4: eager
    runner.discard(prep)
    prep = runner.prepare(Step(KVStep((KVSpan("a", "text", 4), KVSpan("b", "text", 4)))))
    assert prep.graph is not None and prep.ctx.bucket == 2
    runner.discard(prep)


def test_graph_steps_beyond_the_features_query_tokens_are_refused():
    # refused when the runner is made, before warm-up takes a sink page or buffers
    with pytest.raises(ValueError, match=r"query_tokens=4, .*\['kv', 'attn'\].*decode_query_tokens=2"):
        multi_token_graph_node(4, features=AttentionFeatures(decode_query_tokens=2))
    _, kv, _, node, runner = multi_token_graph_node(2, features=AttentionFeatures(decode_query_tokens=2))
    assert kv.sink_page is None and kv.num_free_pages == kv.config.max_pages
    with pytest.raises(ValueError, match=r"query_tokens must be an int in 1..8"):
        GraphRunner(node, lambda ctx, t: t, [2], "cpu", query_tokens=9)


class SpyDecode(R.ReferenceDecodeWrapper):
    """The reference decode wrapper, recording what each plan asked for."""

    planned: list = []

    def plan(self, plan):  # a 2.0 wrapper: the plan object carries query_tokens
        SpyDecode.planned.append(plan.query_tokens)
        return super().plan(plan)


@pytest.mark.parametrize("t", [2, 4])
def test_multi_token_rows_on_a_decode_wrapper_that_declares_them(t):
    """Where the selection says the decode wrapper runs them, uniform rows of t go there -- in the
    graph steps and eagerly -- with query_tokens=t; the logits match the full forward."""
    SpyDecode.planned = []
    wrappers = {**REF_WRAPPERS, "paged_decode": SpyDecode}
    model, kv, attn, node, runner = multi_token_graph_node(t, wrappers=wrappers, multi_token_wrapper="paged_decode")
    runner.warmup()
    verify_multi_token_decode(model, node, runner, t)
    assert t in SpyDecode.planned
    assert [k[1] for k in attn._wrappers if k[3] is not None] == ["paged_decode"] * len(
        [k for k in attn._wrappers if k[3] is not None])  # no graph-mode prefill wrapper was built
    with pytest.raises(ValueError, match="multi_token_wrapper must be 'paged_decode' or 'paged_prefill'"):
        multi_token_graph_node(t, multi_token_wrapper="mixed")


class SizedDecode(R.ReferenceDecodeWrapper):
    """The reference decode wrapper, recording the query tokens per row each graph-mode wrapper
    was built for and each plan asked for."""

    built: list = []
    planned: list = []

    @classmethod
    def from_size(cls, size):  # a 2.0 wrapper: built from its WrapperSize
        if size.accelerator_graph:
            SizedDecode.built.append(size.query_tokens)
        return super().from_size(size)

    def plan(self, plan):
        SizedDecode.planned.append(plan.query_tokens)
        return super().plan(plan)


@pytest.mark.parametrize("runner_tokens", [1, 2])
def test_a_runner_of_fewer_query_tokens_than_the_features_allow_replays_them_on_the_decode_wrapper(runner_tokens):
    """Features allowing 4 query tokens per row, a runner capturing fewer: the decode wrapper
    that runs multi-token rows is built and planned for the runner's rows (one token: a plain
    decode wrapper), never a graph-mode prefill wrapper; the logits match the full forward."""
    SizedDecode.built, SizedDecode.planned = [], []
    wrappers = {**REF_WRAPPERS, "paged_decode": SizedDecode}
    model, _, attn, node, runner = multi_token_graph_node(runner_tokens, AttentionFeatures(decode_query_tokens=4),
                                                          wrappers=wrappers, multi_token_wrapper="paged_decode")
    runner.warmup()
    verify_multi_token_decode(model, node, runner, runner_tokens)
    graph_kinds = {k[1] for k in attn._wrappers if k[3] is not None}
    assert graph_kinds == {"paged_decode"}
    assert SizedDecode.built and set(SizedDecode.built) == {runner_tokens}
    assert set(SizedDecode.planned) == {runner_tokens}
