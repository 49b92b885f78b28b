"""The persistent page table: what a plan gathers on the device equals what the host
page lists say, across table growth, row reuse, fork, reset, rollback and uncommitted tokens."""

import random

import numpy as np
import pytest
import torch

from mstar_core import KVSpan, KVStep, Step, StepContext
from mstar_core.errors import StateError
from mstar_core.kv.page_table import PageTable

from ..helpers import small_kv


def host_truth(lay):
    """kv_indices, write pages, offsets and positions from the spans' host page lists."""
    ps = lay.page_size
    indices, pages, offs, pos = [], [], [], []
    for s in lay.spans:
        indices += list(s.pages)
        for p in range(s.prefix_len, s.length):
            pages.append(s.pages[p // ps])
            offs.append(p % ps)
            pos.append(p)
    return indices, pages, offs, pos


def check(lay):
    indices, pages, offs, pos = host_truth(lay)
    assert lay.kv_indices.tolist() == indices == lay.kv_indices_host.tolist()
    assert lay.kv_indices.dtype == torch.int32
    ps, lens = lay.page_size, lay.kv_lens.tolist()
    assert lens == [s.length for s in lay.spans]
    assert lay.kv_last_page_len.tolist() == [(x - 1) % ps + 1 if x else 0 for x in lens]
    assert np.diff(lay.kv_indptr.numpy()).tolist() == [-(-x // ps) for x in lens]  # each row's pages
    assert np.diff(lay.qo_indptr.numpy()).tolist() == [s.to_compute for s in lay.spans]
    n = lay.num_tokens
    assert lay.write_pages[:n].tolist() == pages
    assert lay.write_offsets[:n].tolist() == offs
    assert lay.positions[:n].tolist() == pos


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "accelerator-path"])
def test_random_lifecycle_matches_the_host_page_lists(on_host):
    """On a CPU the table is written and gathered through numpy; ``on_host=False`` runs the
    accelerator's path (writes uploaded with the rows and scattered, a binary-search gather) on
    the CPU tensors."""
    rng = random.Random(12)
    kv = small_kv(max_pages=400, page_size=4)
    kv.table.on_host = on_host
    rids = [f"r{i}" for i in range(12)]
    for r in rids:
        kv.ingest_request(r)
    grew = set()
    for it in range(300):
        op = rng.random()
        live = [r for r in rids if ("t" in [k[1] for k in kv.streams if k[0] == r])]
        if op < 0.06 and live:
            kv.reset_request(rng.choice(live))
            continue
        if op < 0.1 and live:
            src = rng.choice(live)
            dst = f"f{it}"
            kv.ingest_request(dst)
            if kv.fork(src, dst, "t"):
                rids.append(dst)
            continue
        chosen = rng.sample(rids, k=min(len(rids), rng.randint(1, 6)))
        spans = tuple(KVSpan(r, "t", rng.choice([1, 1, 1, 2, 5, 9]), commit=rng.random() > 0.15) for r in chosen)
        step, ctx = Step(KVStep(spans)), StepContext()
        if not kv.admit(step, ctx):
            for r in chosen:
                kv.reset_request(r)
            continue
        lay = kv.plan(step, ctx).layout("t")
        check(lay)
        grew.add((kv.table.rows, kv.table.cols))
        if rng.random() < 0.2:
            kv.rollback_admit(step, ctx)
        else:
            kv.commit(step, ctx)
            check(lay)  # a plan stays readable after its step lands (copy-on-truncate)
    kv.post_warmup_validate()
    assert len(grew) > 1, "the table never grew: the test did not cover growth"


def test_a_reset_streams_row_is_not_reused_while_its_step_is_in_flight():
    kv = small_kv(max_pages=64, page_size=4)
    for r in "ab":
        kv.ingest_request(r)
    step, ctx = Step(KVStep((KVSpan("a", "t", 6),))), StepContext()
    assert kv.admit(step, ctx)
    lay = kv.plan(step, ctx).layout("t")
    row = kv.stream("a", "t").table_row
    kv.reset_request("a")  # the step is in flight: pages parked, row kept
    s2, c2 = Step(KVStep((KVSpan("b", "t", 9),))), StepContext()
    assert kv.admit(s2, c2)
    check(kv.plan(s2, c2).layout("t"))
    assert kv.stream("b", "t").table_row != row
    check(lay)  # the in-flight step's per-token arrays still name its own pages
    kv.commit(step, ctx)  # lands: pages and row released
    kv.commit(s2, c2)
    assert row in kv.table._free_rows
    kv.post_warmup_validate()


CPU = torch.device("cpu")


def test_a_new_table_holds_nothing_until_a_row_is_written():
    t = PageTable(CPU, max_pages=64)
    assert t.prepare() == 0 and (t.rows, t.cols, t.table.numel()) == (0, 0, 0)
    assert t.gather_host(np.zeros(0, np.int32), np.zeros(0, np.int32), 0).tolist() == []


def test_rows_are_handed_out_from_zero_and_a_released_one_first():
    t = PageTable(CPU, max_pages=8)
    assert [t.assign() for _ in range(3)] == [0, 1, 2]
    t.release(1)
    t.release(-1)  # a stream that never got pages holds no row
    assert [t.assign(), t.assign()] == [1, 3]


def test_the_table_grows_by_doubling_from_16_and_never_wider_than_the_cache():
    t = PageTable(CPU, max_pages=40)
    rows = [t.assign() for _ in range(16)]
    t.write(rows[3], 0, list(range(100, 116)))  # 16 rows x 16 columns: exactly the first size
    assert t.prepare() == 16 and (t.rows, t.cols) == (16, 16)
    t.stage(0)  # the writes land in the table (host memory on a CPU)
    rows.append(t.assign())
    t.write(rows[-1], 0, list(range(17)))
    assert t.prepare() == 32 and (t.rows, t.cols) == (32, 32)
    t.stage(0)
    t.write(rows[-1], 17, list(range(17, 40)))  # 40 columns: the next doubling (64) is capped at the cache's 40
    assert t.prepare() == 40 and (t.rows, t.cols) == (32, 40)
    t.stage(0)
    # what was written before each growth is still where its row and column say
    base = np.array([rows[3] * 40, rows[-1] * 40 - 16], dtype=np.int32)  # row * cols - kv_indptr
    got = t.gather_host(np.array([16, 40]), base, 56).tolist()
    assert got == list(range(100, 116)) + list(range(40))


def test_a_table_past_int32_indexing_is_refused_before_it_is_allocated():
    meta = torch.device("meta")  # sizes without memory
    t = PageTable(meta, max_pages=1 << 27)
    t.write(t.assign(), (1 << 27) - 1, [0])  # 16 rows x 2**27 columns: 2**31 entries
    with pytest.raises(StateError, match="16 streams x 134217728 pages exceeds int32 indexing"):
        t.prepare()
    t = PageTable(meta, max_pages=(1 << 27) - 1)
    t.write(t.assign(), (1 << 27) - 2, [0])
    assert t.prepare() == (1 << 27) - 1 and t.table.numel() == 16 * ((1 << 27) - 1)


def test_a_stage_leads_with_the_pending_writes_once_then_room_for_n():
    t = PageTable(CPU, max_pages=8)
    t.on_host = False  # the accelerator's path: writes go up with the rows and are scattered there
    row = t.assign()
    t.write(row, 0, [5, 6])
    t.prepare()
    cpu, a, at = t.stage(3)
    assert at == 4 and a.shape == (7,) and a[:4].tolist() == [row * 8, row * 8 + 1, 5, 6]
    t.send(cpu, at)
    assert t.table[row * 8: row * 8 + 2].tolist() == [5, 6]
    _, a, at = t.stage(3)
    assert at == 0 and a.shape == (3,)  # written already: not sent again


def test_aranges_are_views_of_one_buffer_grown_only_for_a_longer_range():
    t = PageTable(CPU, max_pages=8)
    a, h = t.arange(1024), t.host_arange(1024)
    assert a.tolist() == h.tolist() == list(range(1024)) and a.dtype == torch.int32 and h.dtype == np.int32
    assert t.arange(1024).data_ptr() == t.arange(7).data_ptr() == a.data_ptr()  # no kernel
    assert np.shares_memory(t.host_arange(1024), h) and np.shares_memory(t.host_arange(7), h)
    assert t.arange(1025).tolist() == t.host_arange(1025).tolist() == list(range(1025))
