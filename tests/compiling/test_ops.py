"""mstar's custom ops (``mstar_core.ops``): ``torch.library.opcheck`` over a planned step of each
manager (schema and declared mutation, fake tensors, AOT dispatch), what each manager traces to
under ``torch.compile`` (one op, no graph break), and that a compiled call equals the eager one,
including where the compiler hands an op a copy of the cache."""

from __future__ import annotations

import logging

import pytest
import torch

from mstar_core import (
    BoundedKVConfig,
    BoundedKVManager,
    KVConfig,
    KVManager,
    Node,
    PagedAttentionManager,
    StepContext,
)
from mstar_core.errors import InputError, StateError

from ..helpers import REF_WRAPPERS, bstep, dense, step

OPCHECK_TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _paged(device="cpu", wrappers=REF_WRAPPERS, dtype=torch.float32):
    cfg = KVConfig(2, 2, 64, 16, 16, 4)
    kv = KVManager(cfg, device, dtype)
    attn = PagedAttentionManager(kv, device, dtype, cfg, wrappers)
    node = Node([kv, attn])
    for r in ("a", "b"):
        node.ingest_request(r)
    st = step(("a", "text", 5), ("b", "text", 3))
    ctx = StepContext()
    assert node.admit(st, ctx)
    node.plan(st, ctx)
    g = torch.Generator().manual_seed(0)

    def rand(h):
        return torch.randn(8, h, 64, generator=g).to(device, dtype)

    return kv, attn, node, (st, ctx), rand(4), rand(2), rand(2)


def test_write_kv_and_paged_run_pass_opcheck():
    kv, attn, _, _, q, k, v = _paged()
    torch.library.opcheck(torch.ops.mstar.write_kv.default, (k, v, kv.storage, kv.op_handle, 1, "text"),
                          test_utils=OPCHECK_TESTS)
    torch.library.opcheck(torch.ops.mstar.paged_run.default, (q, kv.layer_view(1), attn.op_handle, 1, "text", None),
                          test_utils=OPCHECK_TESTS)


def _compiled(fn, backend="aot_eager"):
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_paged_layer_compiles_to_the_ops_and_matches_eager(backend, caplog):
    kv, attn, node, _, q, k, v = _paged()

    def layer(q, k, v):
        kv.write_kv(k, v, layer_idx=1, label="text")
        return attn.run(q, "text", kv.layer_view(1), layer_idx=1)

    explain = torch._dynamo.explain(layer)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    ops = {str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"mstar.write_kv.default", "mstar.paged_run.default"} <= ops, ops
    want = layer(q, k, v)
    before = kv.storage.clone()
    kv.storage.zero_()
    with caplog.at_level(logging.WARNING, logger="mstar_core.ops"):
        got = _compiled(layer, backend)(q, k, v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(kv.storage, before)  # the write landed in the cache itself
    # Inductor writes the cache in place; aot_eager hands the op a copy, which it says.
    copied = any("copy of the cache" in r.getMessage() for r in caplog.records)
    assert copied == (backend == "aot_eager")


def test_one_compiled_graph_serves_every_step_of_its_shape():
    kv, attn, node, (st, ctx), q, k, v = _paged()
    attn.run(q, "text", kv.layer_view(0), layer_idx=0)  # the prompts, eagerly
    node.commit(st, ctx)

    def layer(q, k, v):
        kv.write_kv(k, v, layer_idx=0, label="text")
        return attn.run(q, "text", kv.layer_view(0), layer_idx=0)

    fn = _compiled(layer)
    g = torch.Generator().manual_seed(5)
    for n in range(3):  # decode steps: each its own plan, the same graph (a recompile would raise)
        dec = step(("a", "text", 1), ("b", "text", 1))
        c = StepContext()
        assert node.admit(dec, c)
        node.plan(dec, c)
        q1, k1, v1 = (torch.randn(2, h, 64, generator=g) for h in (4, 2, 2))
        with torch._dynamo.config.patch(error_on_recompile=n > 0):
            got = fn(q1, k1, v1)
        written = kv.storage.clone()
        torch.testing.assert_close(got, layer(q1, k1, v1))
        torch.testing.assert_close(kv.storage, written)
        node.commit(dec, c)
    assert kv.streams[("a", "text")].length == 8 and kv.streams[("b", "text")].length == 6


def test_a_compiled_layer_reads_the_label_it_names_and_the_layer_of_its_layer_idx():
    cfg = KVConfig(2, 2, 64, 16, 16, 4)
    kv = KVManager(cfg, "cpu", torch.float32)
    attn = PagedAttentionManager(kv, "cpu", torch.float32, cfg, REF_WRAPPERS)
    node = Node([kv, attn])
    node.ingest_request("a")
    ctx = StepContext()
    st = step(("a", "text", 5), ("a", "audio", 3))
    assert node.admit(st, ctx)
    node.plan(st, ctx)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(1))
    got = _compiled(lambda q: attn.run(q, "audio", layer_idx=1))(q)  # no view given: layer_idx's
    torch.testing.assert_close(got, attn.run(q, "audio", kv.layer_view(1), layer_idx=1))
    given = torch.randn_like(kv.layer_view(1))  # what a compiler may hand over for the layer: read as given
    got = _compiled(lambda q, layer: attn.run(q, "audio", layer, layer_idx=1))(q, given)
    torch.testing.assert_close(got, attn.run_eager(q, "audio", given, 1, None, check_view=False))
    with pytest.raises(InputError, match=r"label=None is ambiguous: this step has labels \['text', 'audio'\]"):
        _compiled(lambda q: attn.run(q, layer_idx=1))(q)
    # a whole graph cannot raise: the compiler reports the refusal
    with pytest.raises(torch._dynamo.exc.Unsupported, match="PagedAttentionManager.run under torch.compile needs "
                                                            "layer_idx"):
        _compiled(lambda q: attn.run(q, "audio", kv.layer_view(1)))(q)
    node.rollback_admit(st, ctx)


def test_an_op_of_a_manager_that_is_gone_is_refused():
    kv, attn, _, _, q, k, v = _paged()
    handle = attn.op_handle
    layer = kv.layer_view(0)
    del attn
    import gc

    gc.collect()
    with pytest.raises(StateError, match="no longer exists"):
        torch.ops.mstar.paged_run(q, layer, handle, 0, "text", None)


def test_dense_run_passes_opcheck_and_compiles():
    cfg = KVConfig(2, 2, 32, 16, 16, 4)
    kv = KVManager(cfg, "cpu", torch.float32)
    attn = dense()(kv, cfg)
    node = Node([kv, attn])
    node.ingest_request("a")
    g = torch.Generator().manual_seed(1)
    first = step(("a", "text", 6))
    ctx = StepContext()
    assert node.admit(first, ctx)
    node.plan(first, ctx)
    q, k, v = (torch.randn(6, h, 32, generator=g) for h in (4, 2, 2))
    for i in range(2):
        attn.run(q, "text", k=k, v=v, layer_idx=i)
    node.commit(first, ctx)
    nxt = step(("a", "text", 3))  # a prefix now: the op gathers it from the cache it is given
    ctx = StepContext()
    assert node.admit(nxt, ctx)
    node.plan(nxt, ctx)
    q, k, v = (torch.randn(3, h, 32, generator=g) for h in (4, 2, 2))
    torch.library.opcheck(torch.ops.mstar.dense_run.default, (q, k, v, kv.storage, attn.op_handle, 0, "text", None),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))

    def layer(q, k, v):
        return attn.run(q, "text", k=k, v=v, layer_idx=1)

    assert torch._dynamo.explain(layer)(q, k, v).graph_break_count == 0
    want = layer(q, k, v)
    torch.testing.assert_close(_compiled(layer)(q, k, v), want)


def test_bounded_attend_passes_opcheck_and_compiles():
    cfg = BoundedKVConfig(num_layers=2, max_slots=3, rows=2, num_heads=2, head_dim=8, sink=1, window=3)
    mgr = BoundedKVManager(cfg, "cpu", kv_dtype=torch.float32)
    mgr.ingest_request("a")
    st = bstep(("a", 2))
    ctx = StepContext()
    assert mgr.admit(st, ctx)
    mgr.plan(st, ctx)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(cfg.rows, 4 if i == 0 else 2, 2, 8, generator=g) for i in range(3))
    torch.library.opcheck(torch.ops.mstar.bounded_attend.default,
                          (q, k, v, mgr.storage, mgr.op_handle, 0, None, None, False, None, None),
                          test_utils=OPCHECK_TESTS)

    def layer(q, k, v):
        return mgr.attend(1, q, k, v)

    assert torch._dynamo.explain(layer)(q, k, v).graph_break_count == 0
    want = layer(q, k, v)
    saved = mgr.storage.clone()
    mgr.storage.zero_()
    torch.testing.assert_close(_compiled(layer)(q, k, v), want)
    torch.testing.assert_close(mgr.storage[1], saved[1])
