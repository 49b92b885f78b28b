"""The shared-prefix demo: requests that share system prompts through the paged KV manager's
prefix cache (hits, evictions, a prompt found whole) match the no-cache forward token for token;
pages shared wrongly, or a shared page that does not hold what was computed, fail it."""

from __future__ import annotations

import re

import pytest
import torch

from mstar_core.cli import main
from mstar_core.demo import shared_prefix as S
from mstar_core.kv import KVManager
from mstar_core.kv.prefix import PrefixCache

from ..helpers import REF_WRAPPERS


@pytest.fixture(scope="module")
def report():
    return S.run_shared_prefix(REF_WRAPPERS, "reference")


def _number(text: str, pattern: str) -> int:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return int(m.group(1))


def test_the_cli_run_reports_hits_evictions_and_the_match(capsys):
    assert main(["demo", "--workload", "shared-prefix"]) == 0
    out = capsys.readouterr().out
    assert "backend: reference" in out
    assert _number(out, r"found cached: (\d+) \(hit rate") > 0
    assert _number(out, r"evicted: (\d+)") > 0
    tokens = sum(a.new for a in S.SharedPrefixShape().arrivals)
    assert f"all {tokens} tokens match the no-cache forward: OK" in out and "MISMATCH" not in out


def test_what_the_cache_did(report):
    assert report.ok, report.lines()
    assert report.max_error < 1e-4
    c, p = report.cached, report.plain
    st = c.stats
    assert p.stats is None
    reqs = c.requests
    prompt = sum(len(r.prompt) for r in reqs.values())
    assert st.lookups == len(reqs) and st.lookup_tokens == prompt
    # every prompt token was found cached or computed; without the cache, all were computed
    assert c.prefill + st.hit_tokens == prompt == p.prefill
    assert st.hit_tokens == sum(r.cached for r in reqs.values()) > prompt // 3
    assert st.evicted > 0 and st.published > st.evicted
    # r0 and r1 arrive together with the same system prompt: neither finds the other's pages
    assert reqs["r0"].cached == reqs["r1"].cached == 0
    assert reqs["r3"].cached == 24  # system prompt 0's three pages, published by then
    # r5 repeats r0's 33 tokens: 32 found (4 full pages), the last one computed
    assert reqs["r5"].prompt == reqs["r0"].prompt
    assert (reqs["r5"].cached, reqs["r5"].computed) == (32, 1)
    # later, system prompt 0's pages were evicted (deepest first): r14 finds fewer than r3 did
    assert reqs["r14"].cached < reqs["r3"].cached
    # the same tokens with the cache and without
    assert all(r.generated == p.requests[rid].generated for rid, r in reqs.items())


def test_another_seed_still_hits_and_evicts():
    rep = S.run_shared_prefix(REF_WRAPPERS, "reference", seed=3)
    assert rep.ok, rep.lines()
    assert rep.cached.stats.hit_tokens > 0 and rep.cached.stats.evicted > 0


def test_pages_shared_under_the_wrong_key_are_caught(monkeypatch, capsys):
    """A cache that keyed a page by its parent alone (not its tokens) hands one system prompt's
    pages to requests of another: their logits no longer match the no-cache forward."""
    monkeypatch.setattr(PrefixCache, "_page_key", lambda self, node, tokens, i: (node, ()))
    rep = S.run_shared_prefix(REF_WRAPPERS, "reference")
    assert not rep.ok and rep.max_error > 1e-2
    assert any("with the cache: a logit" in m for m in rep.mismatches)
    assert not any("without the cache" in m for m in rep.mismatches)  # the run without it is right
    assert main(["demo", "--workload", "shared-prefix"]) == 1
    assert "MISMATCH: " in capsys.readouterr().out


def test_a_shared_page_holding_other_numbers_is_caught(monkeypatch):
    """The pages a hit hands out must hold what the publishing request computed: noise written into
    the first shared page of each hit fails the comparison."""
    admit = KVManager.admit_prefix

    def corrupting(self, rid, label, token_ids, root=b""):
        out = admit(self, rid, label, token_ids, root)
        if out.cached_tokens:
            page = self.stream(rid, label).pages[0]
            self.storage[:, page] += torch.randn_like(self.storage[:, page])
        return out

    monkeypatch.setattr(KVManager, "admit_prefix", corrupting)
    rep = S.run_shared_prefix(REF_WRAPPERS, "reference")
    assert not rep.ok and rep.max_error > 1e-2


def test_tensor_parallelism_is_refused(capsys):
    assert main(["demo", "--workload", "shared-prefix", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "tensor parallelism runs the text workload (the shared-prefix workload runs on one rank)" in err
    assert "Traceback" not in err


def test_the_options_reach_the_workload(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(S, "main", lambda **kw: seen.append(kw) or 0)
    cfg = tmp_path / "mstar.toml"
    cfg.write_text('[attention]\nbackend = "reference"\n')
    assert main(["demo", "--workload", "shared-prefix", "--backend", "reference", "--seed", "7",
                 "--config", str(cfg)]) == 0
    (kw,) = seen
    assert kw["backend"] == "reference" and kw["device"] == "cpu" and kw["seed"] == 7 and kw["config"] is not None


def test_an_unknown_backend_is_one_line(capsys):
    assert main(["demo", "--workload", "shared-prefix", "--backend", "no-such-backend"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar demo: error: attention backend 'no-such-backend'") and "Traceback" not in err
