"""Second, focused tests for core behaviours that only one other test pinned down (issue 10):
page accounting and write locations of the paged KVManager, the attention manager's wrapper
choice, the runner's and the graph runner's lifecycle bookkeeping."""

from __future__ import annotations

import pytest
import torch

from mstar_core import (
    AttentionStep,
    CommitError,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Shortage,
    Step,
    StepContext,
)
from mstar_core.backends import reference as R
from mstar_core.kv.pool import PagePool
from mstar_core.testing.oracle import attention_oracle, rel_error

from ..helpers import REF_WRAPPERS, Logged, small_kv, tiny_graph_node


def step(*spans):
    return Step(KVStep(tuple(KVSpan(*s) for s in spans)))


def run_step(kv, st, k=None, layer=0):
    ctx = StepContext()
    assert kv.admit(st, ctx)
    plan = kv.plan(st, ctx)
    if k is not None:
        kv.write_kv(k, -k, layer, st.kv.spans[0].label)
    kv.commit(st, ctx)
    return plan


# -- PagePool ------------------------------------------------------------------------------------


def test_pool_hands_returned_pages_out_again_in_the_order_they_were_returned():
    """The pool is a stack: the pages just given back are the next handed out, in the order they
    were given back, so the same calls always give the same pages."""
    pool = PagePool(8)
    assert pool.take(5) == [0, 1, 2, 3, 4]
    pool.give_back([3, 1, 4])
    assert pool.take(2) == [3, 1]
    assert pool.take(2) == [4, 5]
    assert pool.num_free == 2 and pool.used == frozenset({0, 1, 2, 3, 4, 5})


def test_pool_refuses_a_page_given_back_twice_in_one_call():
    """Returning the same page twice in one ``give_back`` is a double free: refused, and the pool
    is left as it was (the page is not listed free twice)."""
    pool = PagePool(4)
    pages = pool.take(3)
    with pytest.raises(RuntimeError, match=r"pages \[1\] returned but not in use \(double free\)"):
        pool.give_back([1, 2, 1])
    assert pool.num_free == 1 and pool.used == frozenset(pages)
    pool.give_back(pages)
    assert pool.num_free == 4 and sorted(pool.take(4)) == [0, 1, 2, 3]


# -- KVManager.admit: per-request shortages ---------------------------------------------------


def test_refusal_counts_each_request_against_what_earlier_requests_took():
    """A refused admit names every request that does not fit once the requests before it in the
    step (that do fit) have taken their pages: ``available`` is what is left after them, and a
    request that does not fit takes nothing from the later ones."""
    kv = small_kv(max_pages=5, page_size=4)
    for r in "abcd":
        kv.ingest_request(r)
    # a: 2 pages (fits, 3 left), b: 4 (short, 3 left), c: 3 (fits, 0 left), d: 1 (short, 0 left)
    out = kv.admit(step(("a", "t", 8), ("b", "t", 13), ("c", "t", 12), ("d", "t", 1)), StepContext())
    assert not out
    assert out.shortages == (
        Shortage("kv", "pages", 10, 5),
        Shortage("kv", "pages", 4, 3, "b"),
        Shortage("kv", "pages", 1, 0, "d"),
    )
    assert kv.num_free_pages == 5 and not kv.streams


# -- KVManager.fork ----------------------------------------------------------------------------


def test_fork_copies_the_pages_of_every_layer():
    """``fork`` gives the destination fresh pages holding the source's K and V in every layer,
    not only the first."""
    kv = small_kv(max_pages=8, page_size=4, layers=3)
    for r in "ab":
        kv.ingest_request(r)
    st = step(("a", "t", 6))
    ctx = StepContext()
    assert kv.admit(st, ctx)
    kv.plan(st, ctx)
    g = torch.Generator().manual_seed(0)
    for layer in range(3):
        k = torch.randn(6, 2, 8, generator=g, dtype=torch.float64)
        kv.write_kv(k, k + 100 * layer, layer, "t")
    kv.commit(st, ctx)
    assert kv.fork("a", "b", "t")
    a, b = kv.stream("a", "t"), kv.stream("b", "t")
    assert set(a.pages).isdisjoint(b.pages)
    for layer in range(3):
        view = kv.layer_view(layer)
        assert view[b.pages].abs().sum() > 0, f"layer {layer}: fork left the destination pages empty"
        assert torch.equal(view[b.pages], view[a.pages]), f"layer {layer} differs after fork"


# -- KVManager.reset_request: generations --------------------------------------------------------


def test_reset_gives_each_stream_a_generation_it_never_had():
    """``reset_request`` bumps the ``generation`` of every stream of the request (each label),
    to a value no stream of the manager held before: a cache keyed on the old generation can
    never match the reset stream."""
    kv = small_kv(max_pages=8, page_size=4)
    kv.ingest_request("a")
    kv.ingest_request("b")
    run_step(kv, step(("a", "t", 5), ("a", "u", 2), ("b", "t", 3)))
    seen = {s.generation for s in kv.streams.values()}
    before = {k: s.generation for k, s in kv.streams.items()}
    kv.reset_request("a")
    for label in ("t", "u"):
        g = kv.stream("a", label).generation
        assert g not in seen, f"stream ('a', {label!r}) kept or reused generation {g} after the reset"
        seen.add(g)
    assert kv.stream("b", "t").generation == before[("b", "t")]  # another request: untouched


# -- KVManager plan: FlashInfer-style arrays -----------------------------------------------------


@pytest.mark.parametrize("tokens,want", [(4, 4), (8, 4), (5, 1), (7, 3)])
def test_last_page_len_counts_a_full_last_page_as_page_size(tokens, want):
    """``kv_last_page_len`` is the number of tokens in each row's last page, 1..page_size: a row
    that ends exactly on a page boundary reports ``page_size``, never 0."""
    kv = small_kv(max_pages=8, page_size=4)
    kv.ingest_request("a")
    lay = run_step(kv, step(("a", "t", tokens))).layout("t")
    assert lay.kv_last_page_len.tolist() == [want]
    assert lay.kv_lens.tolist() == [tokens]


# -- KVManager graph mode --------------------------------------------------------------------------


def graph_step(kv, rids, bucket, slot=0):
    st = step(*((r, "t", 1) for r in rids))
    ctx = StepContext(slot=slot, bucket=bucket)
    assert kv.admit(st, ctx)
    return st, ctx, kv.plan(st, ctx).layout("t")


def test_graph_padding_rows_write_to_the_sink_page_not_a_stream_page():
    """A graph step padded to its bucket writes its padding rows to the sink page (offset 0),
    never to a page a stream owns — here page 0 belongs to a stream, so the sink page is not 0."""
    kv = small_kv(max_pages=8, page_size=4)
    for r in "ab":
        kv.ingest_request(r)
    run_step(kv, step(("a", "t", 3)))  # takes page 0 before the sink page is chosen
    kv.build_accelerator_graph_buffers(slots=2, max_bs=4, max_seq_len=64)
    sink = kv.sink_page
    assert sink is not None and sink not in kv.stream("a", "t").pages
    _, _, lay = graph_step(kv, ["a", "b"], bucket=4)
    assert lay.write_pages.numel() == 4
    a_page, b_page = kv.stream("a", "t").pages[0], kv.stream("b", "t").pages[0]
    assert lay.write_pages.tolist() == [a_page, b_page, sink, sink]
    assert lay.write_offsets.tolist() == [3, 0, 0, 0]
    assert lay.positions.tolist() == [3, 0, 0, 0]
    owned = {p for s in kv.streams.values() for p in s.pages}
    assert not set(lay.write_pages[2:].tolist()) & owned


def test_graph_buffers_grow_only_a_smaller_slot_count_keeps_the_slots():
    """``build_accelerator_graph_buffers`` is grow-only: a later call with fewer slots (and more
    rows) keeps every staging slot the first call made, so a graph captured for slot 1 still
    has its buffers."""
    kv = small_kv(max_pages=16, page_size=4)
    kv.build_accelerator_graph_buffers(slots=3, max_bs=2, max_seq_len=64)
    kv.build_accelerator_graph_buffers(slots=1, max_bs=4, max_seq_len=64)
    rids = ["a", "b", "c"]
    for r in rids:
        kv.ingest_request(r)
    for slot in (2, 1, 0):
        st, ctx, lay = graph_step(kv, rids, bucket=4, slot=slot)
        assert lay.write_pages.numel() == 4  # the larger max_bs holds a bucket of 4
        kv.rollback_admit(st, ctx)
    kv.post_warmup_validate()


# -- PagedAttentionManager ---------------------------------------------------------------------------


def paged_node(wrappers=REF_WRAPPERS, **kw):
    kv = small_kv(max_pages=32, page_size=4)
    attn = PagedAttentionManager(kv, "cpu", torch.float64, kv.config, wrappers, **kw)
    return kv, attn, Node([kv, attn])


def commit_prefill(node, *spans):
    """Commit ``(rid, tokens)`` prompts of label "t" (the K/V content does not matter here)."""
    st = step(*((r, "t", n) for r, n in spans))
    assert node.step(st, lambda ctx: None).outcome


@pytest.mark.parametrize("prompts,kind", [((3,), "mixed"), ((3, 2), "mixed"), ((3, 2, 5), "paged_prefill")])
def test_mixed_step_uses_the_mixed_wrapper_up_to_max_prefill_rows(prompts, kind):
    """A step mixing one-token rows with prompt rows runs on the mixed wrapper while its prompt
    rows number at most ``max_prefill_rows`` (the boundary included); only more prompt rows than
    that fall back to one packed prefill plan."""
    kv, attn, node = paged_node(max_prefill_rows=2)
    rids = [f"p{i}" for i in range(len(prompts))]
    for r in ["d", *rids]:
        node.ingest_request(r)
    commit_prefill(node, ("d", 3))
    st = step(("d", "t", 1), *((r, "t", n) for r, n in zip(rids, prompts)))
    ctx = StepContext()
    assert node.admit(st, ctx)
    node.plan(st, ctx)
    (entry,) = ctx.plan_results["attn"].entries
    assert entry.kind == kind
    assert entry.num_tokens == 1 + sum(prompts)
    node.rollback_admit(st, ctx)


def test_decode_step_applies_the_steps_window():
    """A decode-only step plans its wrapper with the step's ``window_left``: each one-token row
    sees only its last ``window_left + 1`` keys (checked against the oracle, and against the
    unwindowed result, which differs)."""
    kv, attn, node = paged_node()
    g = torch.Generator().manual_seed(3)
    hq, hkv, d = kv.config.qo_heads, kv.config.num_kv_heads, kv.config.head_dim
    lens = {"a": 9, "b": 6}
    keys = {r: (torch.randn(n, hkv, d, generator=g, dtype=torch.float64),
                torch.randn(n, hkv, d, generator=g, dtype=torch.float64)) for r, n in lens.items()}
    for r in lens:
        node.ingest_request(r)
    pre = step(*((r, "t", n) for r, n in lens.items()))

    def write_prefix(ctx):
        kv.write_kv(torch.cat([keys[r][0] for r in lens]), torch.cat([keys[r][1] for r in lens]), 0, "t")

    assert node.step(pre, write_prefix).outcome
    q = torch.randn(2, hq, d, generator=g, dtype=torch.float64)
    k1 = torch.randn(2, hkv, d, generator=g, dtype=torch.float64)
    v1 = torch.randn(2, hkv, d, generator=g, dtype=torch.float64)
    outs = {}
    for window in (2, -1):
        st = Step(KVStep((KVSpan("a", "t", 1, False), KVSpan("b", "t", 1, False))), AttentionStep(True, window))

        def forward(ctx):
            assert ctx.plan_results["attn"].entries[0].kind == "paged_decode"
            kv.write_kv(k1, v1, 0, "t")
            return attn.run(q, "t", layer_idx=0)

        outs[window] = node.step(st, forward).output
        for i, r in enumerate(lens):
            ref = attention_oracle(q[i:i + 1], torch.cat([keys[r][0], k1[i:i + 1]]),
                                   torch.cat([keys[r][1], v1[i:i + 1]]), True, window)
            assert rel_error(outs[window][i:i + 1], ref) < 1e-12, (window, r)
    assert rel_error(outs[2], outs[-1]) > 1e-3  # the window really cut keys off


class _FlakyPrefill(R.ReferencePrefillWrapper):
    fail = False

    def plan(self, *args, **kwargs):
        if type(self).fail:
            raise RuntimeError("planted plan failure")
        return super().plan(*args, **kwargs)


def test_a_failed_replan_leaves_the_wrappers_older_plan_unusable():
    """When a later step's plan of a wrapper fails, the step that wrapper was planned for before
    may not run on it any more (the wrapper may hold half of the new plan): its ``run`` is
    refused, not silently computed from a mixed state."""
    kv, attn, node = paged_node({**REF_WRAPPERS, "paged_prefill": _FlakyPrefill}, slots=2)
    for r in "abc":
        node.ingest_request(r)
    ctxs = []
    for r in "ab":  # slot 0, then slot 1
        st, ctx = step((r, "t", 3)), StepContext()
        assert node.admit(st, ctx)
        node.plan(st, ctx)
        ctxs.append((st, ctx))
    _FlakyPrefill.fail = True
    try:
        st3, ctx3 = step(("c", "t", 3)), StepContext()
        assert node.admit(st3, ctx3)
        with pytest.raises(RuntimeError, match="planted plan failure"):
            node.plan(st3, ctx3)  # slot 0 again: the wrapper step a planned
    finally:
        _FlakyPrefill.fail = False
    q = torch.zeros(3, kv.config.qo_heads, kv.config.head_dim, dtype=torch.float64)
    st_a, ctx_a = ctxs[0]
    with node.bound(ctx_a), pytest.raises(RuntimeError, match="re-planned by a later step"):
        attn.run(q, "t", layer_idx=0)
    with node.bound(ctxs[1][1]):
        assert attn.run(q, "t", layer_idx=0).shape == q.shape  # slot 1 was not touched
    for st, ctx in ctxs:
        node.rollback_admit(st, ctx)


# -- Node: refusals, rollbacks, failed commits ---------------------------------------------------------



def test_a_refusal_rolls_back_the_earlier_admits_and_frees_the_streams():
    """When a resource refuses, every resource admitted before it in the step is rolled back —
    the KV manager's pages go back and its streams are no longer in flight, so the same step can
    be admitted again at once — and the refusing one is not rolled back."""
    log = []
    kv = small_kv(max_pages=8, page_size=4)
    gate = Logged("gate", log, deps=("kv", "mid"), refuse=True)
    node = Node([gate, Logged("mid", log, deps=("kv",)), kv])
    node.ingest_request("a")
    st = step(("a", "t", 6))
    out = node.admit(st, StepContext())
    assert not out and "gate: needs 1 tickets" in out.reason()
    assert log == [("admit", "mid"), ("admit", "gate"), ("rollback", "mid")]
    assert kv.num_free_pages == 8 and ("a", "t") not in kv.streams
    gate.refuse = False
    ctx = StepContext()
    assert node.admit(st, ctx)  # nothing of the refused step is left in flight
    node.rollback_admit(st, ctx)


def test_a_refusal_rolls_back_in_reverse_dependency_order():
    """The rollback after a refusal runs over the admitted resources in reverse dependency order
    (the resource that depends on another is undone first)."""
    log = []
    node = Node([Logged("d", log, deps=("c",), refuse=True), Logged("b", log, deps=("a",)),
                 Logged("c", log, deps=("b",)), Logged("a", log)])
    assert not node.admit(step(), StepContext())
    assert log == [("admit", "a"), ("admit", "b"), ("admit", "c"), ("admit", "d"),
                   ("rollback", "c"), ("rollback", "b"), ("rollback", "a")]


class _FailingCommitKV(KVManager):
    fail = True

    def commit(self, step, ctx):
        if self.fail:
            raise OSError("commit lost")
        super().commit(step, ctx)


def test_the_resource_whose_commit_raises_is_rolled_back_itself():
    """A commit that raises leaves that resource's admit undone too (not only the resources
    after it): its pages go back, its streams are not in flight, and the step can run again."""
    kv = _FailingCommitKV(KVConfig(2, 2, 8, 4, 8, 4), "cpu", torch.float64)
    log = []
    node = Node([kv, Logged("after", log, deps=("kv",))])
    node.ingest_request("a")
    st = step(("a", "t", 6))
    with pytest.raises(CommitError) as err:
        node.step(st, lambda ctx: None)
    assert err.value.failed == "kv" and err.value.committed == () and err.value.rolled_back == ("kv", "after")
    assert kv.num_free_pages == 8 and ("a", "t") not in kv.streams
    kv.fail = False
    assert node.step(st, lambda ctx: None).outcome
    assert kv.stream("a", "t").length == 6


# -- GraphRunner: which steps replay --------------------------------------------------------------


def graph_build(graphs=True, buckets=(2, 4)):
    *_, node, runner = tiny_graph_node(graphs, buckets=buckets, layers=1, hidden=32, head_dim=8, seed=5)
    runner.warmup()
    return node, runner


def prompt(node, runner, prompts):
    for r in prompts:
        node.ingest_request(r)
    st = Step(KVStep(tuple(KVSpan(r, "text", len(p)) for r, p in prompts.items())))
    runner.launch(runner.prepare(st), torch.tensor([t for p in prompts.values() for t in p]))


def test_a_decode_step_fills_the_bucket_equal_to_its_rows():
    """A decode step replays in the smallest captured bucket that holds its rows — the bucket
    equal to its row count included — and a step larger than every bucket runs eagerly."""
    node, runner = graph_build(buckets=(2, 4))
    assert [runner.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, None]
    prompt(node, runner, {"a": [1, 2], "b": [3, 4]})
    prep = runner.prepare(Step(KVStep((KVSpan("a", "text", 1), KVSpan("b", "text", 1)))))
    assert prep.graph is not None and prep.ctx.bucket == 2
    runner.discard(prep)


def test_a_decode_step_of_another_label_runs_eagerly():
    """Graphs are captured for one label: a decode step of another label is not replayed
    (it gets no bucket and no graph)."""
    node, runner = graph_build()
    node.ingest_request("a")
    assert node.step(step(("a", "audio", 3)), lambda ctx: None).outcome
    prep = runner.prepare(step(("a", "audio", 1)))
    assert prep.outcome and prep.graph is None and prep.ctx.bucket is None
    runner.discard(prep)


def test_a_decode_step_with_another_sm_scale_is_not_replayed():
    """A replay reuses the kernel arguments recorded at capture, so a decode step whose
    ``sm_scale`` (or causal flag) differs from the captured ones is prepared eagerly — no bucket,
    no graph, its own wrappers — while the same rows with the captured parameters replay."""
    node, runner = graph_build(buckets=(2,))
    prompt(node, runner, {"a": [1, 2, 3], "b": [4, 5]})
    kv_step = KVStep((KVSpan("a", "text", 1), KVSpan("b", "text", 1)))
    for other in (AttentionStep(sm_scale=2.0), AttentionStep(causal=False)):
        prep = runner.prepare(Step(kv_step, other))
        assert prep.outcome and prep.graph is None and prep.ctx.bucket is None, other
        out = runner.launch(prep, torch.tensor([6, 7]))
        assert out.shape[0] == 2 and torch.isfinite(out).all()
    prep = runner.prepare(Step(kv_step))
    assert prep.graph is not None and prep.ctx.bucket == 2
    runner.discard(prep)
