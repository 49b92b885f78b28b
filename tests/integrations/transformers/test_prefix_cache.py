"""Generation with the prefix cache on: greedy ids identical to the run without it on three tiny
architectures (one with sliding windows), prompts that share a prefix compute it once, a prompt
whose whole text is cached still computes its last token, a later run on the same engine finds
what an earlier one generated, and the CLI and config turn it on."""

from __future__ import annotations

import functools

import pytest
import torch

from mstar_core import Engine, EngineOptions
from mstar_core.errors import ConfigError, InputTypeError
from mstar_core.integrations.transformers import generate_report, run
from mstar_core.testing.hf_models import build, config

from .cli_runs import run_json

PAGE = 8


@functools.cache
def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    system = torch.randint(0, vocab, (37,), generator=g).tolist()
    out = [system + torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 0, 20, 3)]
    return [*out, list(out[1]), system[:32]]  # an exact repeat; a page-aligned prompt wholly cached


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_greedy_ids_identical_and_the_shared_prefix_computed_once(arch):
    model = build(arch)
    ps = prompts(model.config.vocab_size)
    off = generate_report(model, ps, 10, "reference", page_size=PAGE, eos_token_id=None)
    on = generate_report(model, ps, 10, "reference", page_size=PAGE, eos_token_id=None, prefix_cache=True)
    assert on.ids == off.ids
    assert off.cached_tokens is None and off.prefill_tokens == sum(map(len, ps))
    assert on.cached_tokens is not None
    # the first prompt computes the 4 full shared pages; every later one finds them (and the repeat
    # finds its own 5 full pages, computing the rest of its last page)
    assert on.cached_tokens[:5] == (0, 32, 32, 32, 32)
    assert on.cached_tokens[5] == 40
    # wholly cached and page aligned: its last page is computed again (the last token always is)
    assert on.cached_tokens[6] == 24
    assert on.prefill_tokens == sum(map(len, ps)) - sum(on.cached_tokens)
    assert on.prefix_hit_rate == pytest.approx(sum(on.cached_tokens) / sum(map(len, ps)))
    assert any(line.startswith("prefix cache: 192 of 300 prompt tokens found") for line in on.lines())


def test_prompts_joining_together_wait_for_the_prefix_one_of_them_computes():
    model = build("llama")
    system = list(range(1, 49))  # 6 pages of 8
    ps = [system + [60 + i] for i in range(4)]
    on = generate_report(model, ps, 3, "reference", page_size=PAGE, eos_token_id=None, prefix_cache=True)
    assert on.cached_tokens == (0, 48, 48, 48)
    # the first prompt alone, then the three that found its pages (one token each: a decode step)
    # beside its first decode row
    assert [(s.rows, s.tokens) for s in on.steps[:2]] == [(1, 49), (4, 4)]
    assert on.ids == generate_report(model, ps, 3, "reference", page_size=PAGE, eos_token_id=None).ids


def test_a_short_shared_prefix_does_not_hold_prompts_back():
    model = build("llama")
    ps = [[1, 2, 3, 4, 5, 6, 7, 8] + list(range(20 + 30 * i, 50 + 30 * i)) for i in range(3)]
    on = generate_report(model, ps, 2, "reference", page_size=PAGE, eos_token_id=None, prefix_cache=True)
    assert on.kinds["prefill"] == 1 and on.waits == 0  # one shared page of 38 tokens: not worth a step
    assert on.cached_tokens == (0, 0, 0)


# (the prompt's length, the full pages it shares with the one joining beside it, whether it waits)
HALF = [(8, 1, False),  # its one page holds its last token, which it computes anyway: nothing to find
        (9, 1, True),  # 8 of its 9 tokens
        (16, 2, True),  # 8 of 16 (its second page holds its last token): exactly half
        (17, 1, False)]  # 8 of 17: less than half


@pytest.mark.parametrize("length, shared, waits", HALF, ids=[f"{n}-tokens-{k}-pages" for n, k, _ in HALF])
def test_a_prompt_waits_for_one_joining_beside_it_when_that_saves_at_least_half_its_prefill(length, shared, waits):
    model = build("llama")
    first = list(range(1, 1 + PAGE * shared)) + [100] * (length - PAGE * shared)
    second = first[:PAGE * shared] + [101] * (length - PAGE * shared)
    with Engine(model, "reference", EngineOptions(max_pages=16, page_size=PAGE, prefix_cache=True)) as e:
        out = run(e, [first, second], 2, eos_token_id=None)
    found = min(PAGE * shared, (length - 1) // PAGE * PAGE)
    assert (out.waits, out.cached_tokens) == ((1, (0, found)) if waits else (0, (0, 0)))
    assert [s.rows for s in out.steps] == ([1, 2, 1] if waits else [2, 2])


def test_the_step_budget_counts_only_the_prompt_tokens_not_found_in_the_cache():
    model = build("llama")
    system = list(range(1, 33))  # 4 pages of 8
    with Engine(model, "reference", EngineOptions(max_pages=32, page_size=PAGE, prefix_cache=True,
                                                  max_prefill_tokens=36)) as e:
        run(e, [system + [40]], 1, eos_token_id=None)  # publishes the system prompt's pages
        # 4 + 30 prompt tokens to compute fit the step's 36; the cached 32 do not count
        out = run(e, [system + [41, 42, 43, 44], list(range(50, 80))], 2, eos_token_id=None)
    assert out.cached_tokens == (32, 0) and out.waits == 0
    assert [(s.rows, s.tokens) for s in out.steps] == [(2, 34), (2, 2)]


def test_without_the_cache_prompts_sharing_pages_join_together():
    model = build("llama")
    same = list(range(1, 1 + 2 * PAGE))
    with Engine(model, "reference", EngineOptions(max_pages=16, page_size=PAGE)) as e:
        out = run(e, [same, same], 2, eos_token_id=None)
    assert out.waits == 0 and [s.rows for s in out.steps] == [2, 2]


def test_a_later_run_finds_what_an_earlier_one_generated():
    model = build("qwen3")
    prompt = list(range(3, 20))
    with Engine(model, "reference", EngineOptions(max_pages=64, page_size=PAGE, prefix_cache=True)) as e:
        first = run(e, [prompt], 16, eos_token_id=None)
        follow = prompt + first.ids[0] + [5, 6]
        second = run(e, [follow], 4, eos_token_id=None)
        assert second.cached_tokens is not None
        # every full page of the prompt and of the generated tokens whose K/V were computed
        assert second.cached_tokens[0] == (len(prompt) + 16 - 1) // PAGE * PAGE
        stats = e.kv.prefix_stats
        assert stats.lookups == 2 and stats.hit_tokens == second.cached_tokens[0]
    with Engine(model, "reference", EngineOptions(max_pages=64, page_size=PAGE)) as e:
        assert run(e, [follow], 4, eos_token_id=None).ids == second.ids


def test_pages_are_evicted_when_the_pool_needs_them_and_ids_stay_identical():
    model = build("llama")
    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(0, 64, (30,), generator=g).tolist() for _ in range(6)]
    kw = dict(page_size=PAGE, max_pages=14, max_batch_size=2, eos_token_id=None, graphs=False)
    off = generate_report(model, ps + ps[:2], 6, "reference", **kw)
    with Engine(model, "reference", EngineOptions(**{k: v for k, v in kw.items() if k != "eos_token_id"},
                                                  prefix_cache=True)) as e:
        on = run(e, ps + ps[:2], 6, eos_token_id=None)
        assert e.kv.prefix_stats.evicted > 0
        e.node.post_warmup_validate()
    assert on.ids == off.ids


def test_a_model_of_another_dtype_or_name_has_another_root():
    model = build("llama")
    with Engine(model, "reference", EngineOptions(max_pages=8, prefix_cache=True)) as a:
        root = a.prefix_root
    assert root is not None
    model.config._name_or_path = "another/model"
    try:
        with Engine(model, "reference", EngineOptions(max_pages=8, prefix_cache=True)) as b:
            assert b.prefix_root != root
    finally:
        model.config._name_or_path = ""
    with Engine(build("llama", dtype=torch.float64), "reference", EngineOptions(max_pages=8, prefix_cache=True)) as c:
        assert c.prefix_root != root


def test_the_config_turns_it_on_and_bad_values_are_refused():
    model = build("llama")
    with Engine(model, "reference", EngineOptions(max_pages=8, config={"kv": {"prefix_cache": True}})) as e:
        assert e.prefix_root is not None and e.kv.prefix_cache
    with Engine(model, "reference", EngineOptions(max_pages=8, prefix_cache=False,
                                                  config={"kv": {"prefix_cache": True}})) as e:
        assert e.prefix_root is None and not e.kv.prefix_cache  # the option wins over the config
    with pytest.raises(ConfigError, match="kv.prefix_cache must be true or false"):
        Engine(model, "reference", EngineOptions(max_pages=8, config={"kv": {"prefix_cache": "yes"}}))
    with pytest.raises(InputTypeError, match="prefix_cache must be a bool"):
        EngineOptions(prefix_cache=1)


def test_cli_reports_tokens_found(tmp_path, capsys):
    config("qwen3").save_pretrained(tmp_path)
    shared = " ".join(str(t) for t in range(1, 34))
    out = run_json(capsys, str(tmp_path), "--ids", "--prompt", f"{shared} 40", "--prompt", f"{shared} 41 42",
                   "--max-new-tokens", "3", "--page-size", "8", "--prefix-cache")
    assert [p["cached_tokens"] for p in out["prompts"]] == [0, 32]
    assert out["prefill_tokens"] == 34 + 3
    assert out["prefix_hit_rate"] == pytest.approx(32 / 69)
    plain = run_json(capsys, str(tmp_path), "--ids", "--prompt", f"{shared} 40", "--prompt", f"{shared} 41 42",
                     "--max-new-tokens", "3", "--page-size", "8")
    assert plain["ids"] == out["ids"] and plain["prefix_hit_rate"] is None


def test_a_joining_prompt_refused_by_the_step_gives_its_cached_pages_back(monkeypatch):
    """A step refused with prompts joining drops the last of them; it must not keep the cached
    pages it took while it waits (nobody counts them), and finds them again when it joins."""
    from mstar_core.graphs import Prepared
    from mstar_core.step import AdmitOutcome, Shortage

    model = build("llama")
    system = list(range(1, 33))
    ps = [system + [40], system + [41, 42], system + [43]]
    # with a sampler: the requests that join hold their slots once, through the retry
    with Engine(model, "reference", EngineOptions(max_pages=32, page_size=PAGE, prefix_cache=True, sampler=())) as e:
        real = e.runner.prepare
        held: list[tuple[int, int]] = []

        def refuse_the_first_step_of_three(step):
            if held and len(held) == 1:  # the retry without hf2: it holds nothing meanwhile
                held.append((("hf2", "text") in e.kv.streams, len(step.kv.spans)))
            prep = real(step)
            if len(step.kv.spans) == 3 and not held:
                held.append((e.kv.stream("hf2", "text").length, e.kv.pool.num_free))
                e.runner.discard(prep)
                return Prepared(step, prep.ctx, prep.rows, outcome=AdmitOutcome.refuse(Shortage("kv", "pages", 9, 0)))
            return prep

        run(e, [ps[0]], 2, eos_token_id=None)  # publishes the system prompt's 4 pages
        monkeypatch.setattr(e.runner, "prepare", refuse_the_first_step_of_three)
        free_before = e.kv.pool.num_free
        got = run(e, ps, 3, eos_token_id=None)
        assert held[0][0] == 32  # hf2 had taken the cached pages when the step was refused
        assert held[1] == (False, 2)  # and gave them back for the retry without it
        assert got.cached_tokens == (32, 32, 32)  # and found them again when it joined
        assert got.waits == 1
        assert sorted(e.sampler._free) == list(range(e.sampler.pad))
        assert e.kv.pool.num_free == free_before
        e.node.post_warmup_validate()
    with Engine(model, "reference", EngineOptions(max_pages=32, page_size=PAGE)) as plain:
        assert run(plain, ps, 3, eos_token_id=None).ids == got.ids


@pytest.mark.parametrize("kw", [{"graphs": True}, {"kv_dtype": "fp8_e4m3"}, {"graphs": True, "kv_dtype": "fp8_e5m2"}],
                         ids=["graph-path", "fp8", "graph-path-fp8"])
def test_graph_steps_and_fp8_pages_give_the_ids_of_the_run_without_the_cache(kw):
    """Decode steps through the graph path (static per-slot buffers over shared pages) and FP8
    pages (quantised once by the prompt that computed them, read by every prompt that finds them)."""
    model = build("qwen3")
    ps = prompts(model.config.vocab_size)
    off = generate_report(model, ps, 8, "reference", page_size=PAGE, eos_token_id=None, **kw)
    on = generate_report(model, ps, 8, "reference", page_size=PAGE, eos_token_id=None, prefix_cache=True, **kw)
    assert on.ids == off.ids
    assert sum(on.cached_tokens or ()) == 192
    if kw.get("graphs"):
        assert any(s.graph for s in on.steps)
