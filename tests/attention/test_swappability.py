"""One step declaration, two backends. The same steps (commit=True prefixes,
commit=False denoise steps, causal chunks, decode-like one-token rows) run under the paged
manager and the dense manager give the same outputs; so does the tiny decoder, whose layer is
written once for every backend."""

from __future__ import annotations

import pytest
import torch

from mstar_core import PagedAttentionManager
from mstar_core.backends import reference as R

from ..helpers import Harness, dense

PAGED = {"paged_prefill": R.ReferencePrefillWrapper, "paged_decode": R.ReferenceDecodeWrapper,
         "mixed": R.ReferenceMixedWrapper}


def paged(kv, cfg):
    return PagedAttentionManager(kv, "cpu", kv.dtype, cfg, PAGED)


SCRIPT = [
    # (spans, causal)
    ([("a", 20, True), ("b", 16, True)], True),  # conditioning prefixes
    ([("a", 24, False), ("b", 17, False), ("c", 5, False)], False),  # denoise steps
    ([("a", 24, False), ("b", 17, False), ("c", 5, False)], False),
    ([("a", 9, True), ("b", 1, True), ("c", 16, True)], True),  # a chunk, a one-token row, a first chunk
    ([("a", 1, True), ("b", 1, True), ("c", 1, True)], True),  # decode-like
    ([("a", 15, False), ("c", 2, False)], False),
]


@pytest.mark.parametrize("window_left", [-1, 6], ids=["nowin", "win6"])
def test_same_declaration_same_outputs(window_left):
    runs = {}
    for name, make in (("paged", paged), ("dense", dense())):
        h = Harness(make, torch.float64, hq=4, d=32, page_size=8, seed=3)
        h.ingest("a", "b", "c")
        outs = []
        for spans, causal in SCRIPT:
            err, o = h.step(spans, causal=causal, window_left=window_left)
            assert err < 1e-9, (name, spans)
            outs.extend(o)
        runs[name] = (outs, {k: (s.length, len(s.pages)) for k, s in h.kv.streams.items()})
    (po, pstate), (do, dstate) = runs["paged"], runs["dense"]
    assert pstate == dstate  # same committed lengths, same page holdings
    assert len(po) == len(do)
    for a, b in zip(po, do, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_tiny_decoder_runs_under_either_backend():
    """The demo model's layer (``if attn.requires_kv_write: write``; ``attn.run(q, label, layer,
    k=k, v=v, layer_idx=i)``) under both managers: same logits, step for step."""
    from mstar_core import (
        AttentionStep,
        KVConfig,
        KVManager,
        KVSpan,
        KVStep,
        Node,
        Step,
    )
    from mstar_core.demo import TinyDecoder, TinyDecoderConfig

    cfg = TinyDecoderConfig()
    model = TinyDecoder(cfg, "cpu", torch.float64, seed=1)
    gen = torch.Generator().manual_seed(2)
    prompt = {"a": torch.randint(cfg.vocab_size, (13,), generator=gen),
              "b": torch.randint(cfg.vocab_size, (20,), generator=gen)}
    fresh = {"a": torch.randint(cfg.vocab_size, (6,), generator=gen),
             "b": torch.randint(cfg.vocab_size, (3,), generator=gen)}
    logits = {}
    for name in ("paged", "dense"):
        kvc = KVConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 32, cfg.num_qo_heads)
        kv = KVManager(kvc, "cpu", torch.float64)
        attn = paged(kv, kvc) if name == "paged" else dense()(kv, kvc)
        node = Node([kv, attn])
        for r in prompt:
            node.ingest_request(r)
        got = []
        for toks, commit, causal in ((prompt, True, True), (fresh, False, False), (fresh, False, False)):
            spans = tuple(KVSpan(r, "text", len(t), commit) for r, t in toks.items())
            step = Step(KVStep(spans), AttentionStep(causal))
            tokens = torch.cat(list(toks.values()))

            def forward(ctx, tokens=tokens, kv=kv, attn=attn):
                pos = ctx.plan_results["kv"].layout("text").positions
                return model.forward_step(tokens, pos, kv, attn, "text")

            res = node.step(step, forward)
            assert res.outcome
            got.append(res.output)
        logits[name] = got
    for a, b in zip(logits["paged"], logits["dense"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    # and the causal prefill equals a no-cache full forward (a sanity anchor for both)
    full = model.forward_full(prompt["a"])
    torch.testing.assert_close(logits["dense"][0][: len(prompt["a"])], full, rtol=0, atol=1e-9)
