"""What each step of a generation loop launches, on a tiny model on the CPU (where a step has run
when its launch returns, so a finish is seen at once): a prompt joins at its arrival step, a
request takes one row per token it keeps and none after its end-of-sequence token, its stop or
its last new token, and a prompt waits for pages, the step's prompt-token budget or a free row.
The rows come from a spy on the runner's ``launch``, the step numbers from ``on_step`` (called
once per step, rows or not)."""

from __future__ import annotations

import functools

import pytest
import torch

from mstar_core import Engine, EngineOptions, StateError
from mstar_core.integrations.transformers import batching, run
from mstar_core.testing.hf_models import build

PAGE = 8
Rows = dict[int, list[tuple[int, int]]]  # step -> (prompt index, tokens) of each of its rows


@functools.cache
def model_and_prompts():
    model = build("llama")
    g = torch.Generator().manual_seed(4)
    return model, [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 9, 5)]


class Schedule:
    """The rows of every step an engine's runner launches, by step number."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
        self.rows: Rows = {}
        self.steps = 0
        launch = engine.runner.launch

        def spy(prep, tokens):
            # the loop names prompt i's request "hf{i}"
            self.rows[self.steps] = sorted((int(s.request_id.removeprefix("hf")), s.num_tokens)
                                           for s in prep.step.kv.spans)
            return launch(prep, tokens)

        monkeypatch.setattr(engine.runner, "launch", spy)

    def on_step(self, done: int, total: int) -> None:
        self.steps += 1


def expected(prompts: list[list[int]], joins: list[int], rows: list[int]) -> Rows:
    """Prompt ``i`` joining at step ``joins[i]`` with its whole prompt, then one token a step, for
    ``rows[i]`` steps in a row."""
    out: Rows = {}
    for i, (p, j, n) in enumerate(zip(prompts, joins, rows, strict=True)):
        for k in range(n):
            out.setdefault(j + k, []).append((i, len(p) if k == 0 else 1))
    return {s: sorted(r) for s, r in sorted(out.items())}


def engine(model, **kw) -> Engine:
    return Engine(model, "reference", EngineOptions(**{"max_pages": 32, "page_size": PAGE, **kw}))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_each_prompt_joins_at_its_arrival_step(monkeypatch, graphs):
    model, ps = model_and_prompts()
    arrivals = [0, 2, 3, 9]  # steps 7 and 8 run nothing: every request has left
    with engine(model, graphs=graphs, max_batch_size=4) as e:
        sched = Schedule(monkeypatch, e)
        out = run(e, ps, 4, arrivals=arrivals, eos_token_id=None, on_step=sched.on_step)
    assert sched.rows == expected(ps, arrivals, [4] * 4)
    assert sched.steps == 13
    assert [s.rows for s in out.steps] == [len(r) for r in sched.rows.values()]
    assert any(s.graph for s in out.steps) == graphs


@pytest.mark.parametrize("finish", ["eos", "stop", "length"])
def test_a_request_launches_no_row_after_it_finishes(monkeypatch, finish):
    model, ps = model_and_prompts()
    new = 8
    with engine(model) as e:
        free = run(e, ps, new, eos_token_id=None).ids
        kw = {}
        if finish == "eos":
            # a token prompt 0 first gives as its third: it ends there
            kw["eos_token_id"] = next(t for k, t in enumerate(free[0]) if k >= 2 and t not in free[0][:k])
        else:
            kw["eos_token_id"] = None
        if finish == "stop":
            kw["stop"] = lambda i, ids: i == 1 and len(ids) == 2
        sched = Schedule(monkeypatch, e)
        out = run(e, ps, new, arrivals=[0, 1, 1, 2], on_step=sched.on_step, **kw)
    lengths = [len(x) for x in out.ids]
    if finish == "eos":
        assert lengths[0] == free[0].index(kw["eos_token_id"]) + 1 < new
    elif finish == "stop":
        assert lengths[1] == 2
    else:
        assert lengths == [new] * 4
    # one row per token kept, in consecutive steps from its arrival, and none after
    assert sched.rows == expected(ps, [0, 1, 1, 2], lengths)
    assert sum(s.rows for s in out.steps) == out.new_tokens


def test_a_prompt_waits_for_the_pages_of_its_whole_run_until_a_request_leaves(monkeypatch):
    model, _ = model_and_prompts()
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, 128, (4,), generator=g).tolist() for _ in range(3)]
    # 4 + 12 tokens: each prompt needs 1 page to join, 2 by its end; 3 joining at once would run out
    with engine(model, max_pages=4) as e:
        sched = Schedule(monkeypatch, e)
        out = run(e, ps, 12, eos_token_id=None, on_step=sched.on_step, stop=lambda i, ids: i == 0 and len(ids) == 2)
    # prompt 2 waits until prompt 0 leaves after step 1: one deferral a step
    assert sched.rows == expected(ps, [0, 0, 2], [2, 12, 12])
    assert out.waits == 2


@pytest.mark.parametrize("limit, joins", [({"max_prefill_tokens": 20}, [0, 0, 1]), ({"max_batch_size": 2}, [0, 0, 4])],
                         ids=["prompt-tokens", "rows"])
def test_a_prompt_waits_for_the_steps_prompt_budget_or_a_free_row(monkeypatch, limit, joins):
    model, _ = model_and_prompts()
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, 128, (10,), generator=g).tolist() for _ in range(3)]
    with engine(model, **limit) as e:
        sched = Schedule(monkeypatch, e)
        out = run(e, ps, 4, eos_token_id=None, on_step=sched.on_step)
    assert sched.rows == expected(ps, joins, [4] * 3)
    assert out.waits == joins[-1]  # prompt 2 is deferred once a step until it joins


def test_a_prompt_that_needs_the_whole_cache_and_the_whole_step_budget_is_served(monkeypatch):
    model, ps = model_and_prompts()
    p = ps[1][:12]  # 12 + 4 new tokens: exactly the 2 pages of 8, and exactly the step's 12 prompt tokens
    with engine(model, max_pages=2, max_prefill_tokens=12) as e:
        sched = Schedule(monkeypatch, e)
        out = run(e, [p], 4, eos_token_id=None, on_step=sched.on_step)
    assert sched.rows == expected([p], [0], [4])
    assert len(out.ids[0]) == 4 and out.waits == 0


def test_a_loop_that_admits_nothing_stops_after_its_bound_of_steps(monkeypatch):
    model, ps = model_and_prompts()
    monkeypatch.setattr(batching._Loop, "_joining", lambda self, decode: [])  # a bug: no prompt ever joins
    with engine(model) as e:
        sched = Schedule(monkeypatch, e)
        # 100 steps per request and per new token, and 1000 more: 100 * (2 + 3) + 1000, then one past it
        with pytest.raises(StateError, match=r"generate made no progress in 1501 steps \(a bug"):
            run(e, ps[:2], 3, on_step=sched.on_step)
        assert e.kv.requests == ()
    assert sched.rows == {} and sched.steps == 1501


def test_the_last_row_leaving_keeps_the_others_tokens(monkeypatch):
    model, ps = model_and_prompts()
    with engine(model) as e:
        free = run(e, ps[:3], 5, eos_token_id=None).ids
        sched = Schedule(monkeypatch, e)
        # the last row of the step stops after its second token; the rows before it decode on
        out = run(e, ps[:3], 5, eos_token_id=None, on_step=sched.on_step, stop=lambda i, ids: i == 2 and len(ids) == 2)
    assert out.ids == [free[0], free[1], free[2][:2]]
    assert sched.rows == expected(ps[:3], [0, 0, 0], [5, 5, 2])


def test_a_decode_step_the_cache_refuses_is_an_error_naming_the_cache(monkeypatch):
    from mstar_core.graphs import Prepared
    from mstar_core.step import AdmitOutcome, Shortage

    model, ps = model_and_prompts()
    with engine(model) as e:
        real = e.runner.prepare

        def refuse_decode(step):
            prep = real(step)
            if all(s.num_tokens == 1 for s in step.kv.spans):  # nobody joins: nobody can wait instead
                e.runner.discard(prep)
                return Prepared(step, prep.ctx, prep.rows, outcome=AdmitOutcome.refuse(Shortage("kv", "pages", 9, 0)))
            return prep

        monkeypatch.setattr(e.runner, "prepare", refuse_decode)
        with pytest.raises(StateError, match=r"decode step of 2 requests was refused .* the cache \(32 pages\)"):
            run(e, ps[:2], 3, eos_token_id=None)
        assert e.kv.requests == ()


def test_the_attention_takes_a_steps_whole_prompt_budget_and_a_token_for_each_other_row(monkeypatch):
    model, _ = model_and_prompts()
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 5, 12)]
    with engine(model, max_prefill_tokens=12, max_batch_size=3) as e:
        sched = Schedule(monkeypatch, e)
        run(e, ps, 3, arrivals=[0, 0, 1], eos_token_id=None, on_step=sched.on_step)
    # step 1: the two first prompts' decode rows and the whole third prompt
    widest = max(sum(n for _, n in rows) for rows in sched.rows.values())
    assert widest == 2 + 12 <= e.attn.max_total_tokens == 12 + 3


def test_the_graph_buffers_are_sized_for_the_longest_sequence_the_cache_holds(monkeypatch):
    from mstar_core.kv import KVManager

    sizes = []
    build = KVManager.build_accelerator_graph_buffers

    def spy(self, slots, max_bs, max_seq_len):
        sizes.append((max_bs, max_seq_len))
        return build(self, slots, max_bs, max_seq_len)

    monkeypatch.setattr(KVManager, "build_accelerator_graph_buffers", spy)
    model, _ = model_and_prompts()
    with engine(model, max_pages=5, graphs=True, max_batch_size=4):
        pass
    assert sizes == [(4, 5 * PAGE)] and isinstance(sizes[0][1], int)
