"""The persistent page table: what a plan gathers on the device equals what the host
page lists say, across table growth, row reuse, fork, reset, rollback and uncommitted tokens."""

import random

import pytest
import torch

from mstar_core import KVSpan, KVStep, Step, StepContext

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
