"""Bad input refused at the API boundary, each refusal naming what is wrong and what is supported:
``attend``'s tensors, plan and sources, graph buffer sizes, the config and the step part."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mstar_core import BoundedKVConfig, BoundedKVManager, BoundedStep, RowLayout, StepContext, StreamPosition
from mstar_core.errors import InputError, InputTypeError, StateError
from mstar_core.kernels.bounded_attention import table as tb
from mstar_core.kv.bounded.plan import host_table

from ...helpers import bstep

CFG = BoundedKVConfig(num_layers=2, max_slots=3, rows=1, num_heads=2, head_dim=8, sink=1, window=3)


def planned(*spans, mgr: BoundedKVManager | None = None):
    """A manager (new unless given) with ``spans``' requests admitted and planned in one step."""
    mgr = mgr or BoundedKVManager(CFG, "cpu", kv_dtype=torch.float64)
    step = bstep(*spans)
    for rid in step.part("bounded").request_ids:
        mgr.ingest_request(rid)
    ctx = StepContext()
    assert mgr.admit(step, ctx)
    return mgr, mgr.plan(step, ctx)


def qkv(batch: int, heads: int = 2, t: int = 1, d: int = 8) -> torch.Tensor:
    return torch.randn(batch * CFG.rows, heads, t, d, dtype=torch.float64)


def sources(n: int, length: int = 3) -> torch.Tensor:
    """``n`` source prefixes ``[n, rows, H, length, 2D]``."""
    return torch.randn(n, CFG.rows, CFG.num_heads, length, 2 * CFG.head_dim, dtype=torch.float64)


# -- attend ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 2, 8), (2, 2, 1, 8)])
def test_attend_refuses_a_q_not_of_the_plans_batch(shape):
    # a 3-d q whose first dim is the batch, and a 4-d q of another batch
    mgr, plan = planned(("a", 1))
    q = torch.randn(*shape, dtype=torch.float64)
    with pytest.raises(InputError, match=re.escape(f"q must be [B * rows = 1, H, T, D], got {shape}")):
        mgr.attend(0, q, qkv(1), qkv(1), plan=plan)


@pytest.mark.parametrize("heads, d", [(3, 8), (2, 4)])
def test_attend_refuses_k_of_other_heads_or_head_dim(heads, d):
    mgr, plan = planned(("a", 1))
    k = qkv(1, heads=heads, d=d)
    with pytest.raises(InputError, match=rf"k must be \[B \* rows, 2, T, 8\], got \(1, {heads}, 1, {d}\)"):
        mgr.attend(0, qkv(1), k, k, plan=plan)
    assert mgr._uncommitted_writes == {}


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_attend_refuses_none_for_q_k_or_v(name):
    mgr, plan = planned(("a", 1))
    args = {"q": qkv(1), "k": qkv(1), "v": qkv(1), name: None}
    with pytest.raises(InputTypeError, match=rf"attend: {name} must be a torch.Tensor, got NoneType"):
        mgr.attend(0, args["q"], args["k"], args["v"], plan=plan)


def test_attend_refuses_a_plan_that_is_not_a_bounded_plan():
    mgr, plan = planned(("a", 1))
    with pytest.raises(InputTypeError, match="plan must be a BoundedPlan or None, got tuple"):
        mgr.attend(0, qkv(1), qkv(1), qkv(1), plan=tuple(plan))


@pytest.mark.parametrize("bad, named", [
    ([sources(1), torch.tensor([0])], "list"),  # two items, but not a tuple
    ((sources(1), torch.tensor([0]), None), "tuple"),  # a tuple of three
])
def test_attend_refuses_a_row_source_not_a_pair(bad, named):
    mgr, plan = planned(StreamPosition("a", 1, source=-1))
    with pytest.raises(InputTypeError, match=rf"row_source must be a \(storage, slots\) tuple, got {named}"):
        mgr.attend(0, qkv(1), qkv(1), qkv(1), plan=plan, row_source=bad)


def test_attend_refuses_a_row_source_storage_that_is_not_a_tensor():
    mgr, plan = planned(StreamPosition("a", 1, source=-1))
    with pytest.raises(InputTypeError, match="row_source_storage must be a torch.Tensor, got list"):
        mgr.attend(0, qkv(1), qkv(1), qkv(1), plan=plan, row_source=([0.0], torch.tensor([0])))


def test_attend_refuses_row_source_slots_shorter_than_the_batch():
    mgr, plan = planned(StreamPosition("a", 1, source=-1))
    with pytest.raises(InputError, match=r"row_source slots\[0\] = none is out of range: its storage holds 2"):
        mgr.attend(0, qkv(1), qkv(1), qkv(1), plan=plan, row_source=(sources(2), torch.tensor([], dtype=torch.long)))


def test_row_source_slots_are_checked_only_for_rows_reading_the_row_source():
    # row 0 reads source 0, so its row_source entry (-1, out of range) is never read
    mgr, plan = planned(StreamPosition("a", 1, source=0), StreamPosition("b", 1, source=-1))
    out = mgr.attend(0, qkv(2), qkv(2), qkv(2), plan=plan, source=sources(1),
                     row_source=(sources(2), torch.tensor([-1, 1])))
    assert out.shape == (2, 1, 2, 8) and torch.isfinite(out).all()


def test_source_index_zero_reads_the_first_source():
    mgr, plan = planned(StreamPosition("a", 1, source=0))
    src = sources(1)
    q = qkv(1)
    out = mgr.attend(0, q, q, q, plan=plan, source=src)
    # position 0 with nothing retained: softmax over the 3 prefix keys and its own key
    kv = torch.cat([src[0, 0], torch.cat([q[0], q[0]], dim=-1)], dim=1)  # [H, 4, 2D]
    keys, vals = kv[..., :8], kv[..., 8:]
    w = torch.softmax(q[0] @ keys.transpose(-1, -2) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(out[0], (w @ vals).transpose(0, 1))


def test_a_source_index_past_the_last_source_is_refused():
    mgr, plan = planned(StreamPosition("a", 1, source=1))
    with pytest.raises(InputError, match="source index 1 out of range: 1 sources"):
        mgr.attend(0, qkv(1), qkv(1), qkv(1), plan=plan, source=sources(1))
    mgr.attend(0, qkv(1), qkv(1), qkv(1), plan=plan, source=sources(2))  # index 1 of 2 sources is fine


def test_a_source_len_longer_than_the_source_is_refused():
    # 5 keys asked of a source 3 keys long (the last dim, 2D = 16, is not its length)
    mgr, plan = planned(StreamPosition("a", 1, source=0, source_len=5))
    with pytest.raises(InputError, match=r"source_len 5 exceeds source\[0\]'s length 3"):
        mgr.attend(0, qkv(1), qkv(1), qkv(1), plan=plan, source=sources(1, length=3))


# -- graph buffers -----------------------------------------------------------------------------


@pytest.mark.parametrize("slots, max_bs", [(0, 4), (1, 0), (0, 0)])
def test_graph_buffers_refuse_no_slots_or_no_batch(slots, max_bs):
    mgr = BoundedKVManager(CFG, "cpu")
    with pytest.raises(InputError, match=rf"need slots >= 1 and max_bs >= 1, got slots={slots}, max_bs={max_bs}"):
        mgr.build_accelerator_graph_buffers(slots, max_bs, 64)
    assert mgr._graph_tables == []


def test_a_graph_step_before_graph_buffers_is_refused():
    mgr = BoundedKVManager(CFG, "cpu")
    mgr.ingest_request("a")
    step, ctx = bstep(("a", 1)), StepContext(slot=0, bucket=1)
    assert mgr.admit(step, ctx)
    with pytest.raises(StateError, match=r"a graph step \(bucket 1\) needs build_accelerator_graph_buffers first"):
        mgr.plan(step, ctx)


def test_a_graph_step_fills_a_buffer_of_exactly_its_bucket():
    mgr = BoundedKVManager(CFG, "cpu")
    mgr.build_accelerator_graph_buffers(1, 1, 64)  # max_bs 1 is a valid size
    for r in "ab":
        mgr.ingest_request(r)
    first, ctx = bstep(("a", 2)), StepContext(slot=0, bucket=1)
    assert mgr.admit(first, ctx)
    plan = mgr.plan(first, ctx)
    assert plan.table.tolist() == host_table(plan.rows).tolist() and plan.table[0, tb.NUM_TOKENS].item() == 2


# -- config and step part ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["num_layers", "max_slots", "rows", "num_heads", "head_dim", "sink", "window"])
def test_config_refuses_none_but_for_query_window(name):
    kwargs = dict(num_layers=1, max_slots=1, rows=1, num_heads=1, head_dim=8, sink=0, window=4)
    with pytest.raises(InputTypeError, match=rf"BoundedKVConfig.{name} must be an int, got NoneType None"):
        BoundedKVConfig(**{**kwargs, name: None})


def test_config_stores_numpy_ints_as_ints():
    cfg = BoundedKVConfig(*(np.int64(v) for v in (1, 2, 1, 2, 8, 1, 4)), query_window=np.int32(2))
    assert all(type(getattr(cfg, f)) is int for f in ("num_layers", "max_slots", "head_dim", "sink", "query_window"))


def test_config_refuses_a_negative_sink():
    with pytest.raises(InputError, match="BoundedKVConfig.sink must be >= 0, got -1"):
        BoundedKVConfig(1, 1, 1, 1, 8, sink=-1, window=4)


def test_config_takes_a_query_window_of_zero():
    assert BoundedKVConfig(1, 1, 1, 1, 8, sink=0, window=4, query_window=0).query_window == 0
    with pytest.raises(InputError, match=r"query_window must be in \[0, window=4\], got -1"):
        BoundedKVConfig(1, 1, 1, 1, 8, sink=0, window=4, query_window=-1)


def test_config_sizes_a_slot_and_lays_out_a_row():
    cfg = BoundedKVConfig(num_layers=1, max_slots=1, rows=2, num_heads=3, head_dim=8, sink=1, window=4)
    assert cfg.slot_elements == 2 * 3 * (1 + 4) * 2 * 8 and type(cfg.slot_elements) is int
    lay = cfg.row_layout(7, 3)
    assert lay == RowLayout(start=7, num_tokens=3, sink_kept=1, ring_kept=4, source_len=0, commit=True)
    assert lay.end == 10 and lay.retained == 5


def test_a_request_twice_in_one_bounded_step_is_refused():
    with pytest.raises(InputError, match=r"a request appears more than once: \['a', 'b', 'a'\]"):
        BoundedStep((StreamPosition("a", 1), StreamPosition("b", 1), StreamPosition("a", 2)))


def test_stream_position_refuses_none_tokens():
    with pytest.raises(InputTypeError, match="num_tokens must be an int, got NoneType None"):
        StreamPosition("a", None)  # type: ignore[arg-type]


def test_a_row_without_a_source_reads_no_source_keys():
    _, plan = planned(("a", 2))
    assert plan.rows[0][1].source_len == 0
    assert plan.table[0, tb.SOURCE_LEN].item() == 0 and plan.table[0, tb.SOURCE].item() == tb.NO_SOURCE
