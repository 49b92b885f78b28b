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

from ..helpers import multi_token_graph_node, verify_multi_token_decode


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
