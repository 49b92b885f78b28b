"""The main job: the tiny decoder under continuous batching matches the no-cache forward."""

from mstar_core.demo.text import run_text_demo

from ..helpers import REF_WRAPPERS


def test_demo_matches_no_cache_forward():
    rep = run_text_demo(REF_WRAPPERS, "reference")
    assert rep.ok, rep.lines()
    assert rep.max_error < 1e-4
    assert rep.steps["prefill"] >= 1 and rep.steps["mixed"] >= 1 and rep.steps["decode"] >= 1
    assert rep.waits >= 1  # the page pool is small on purpose: an admission is refused and waits


def test_demo_detects_a_wrong_backend():
    class NoWindow(REF_WRAPPERS["paged_decode"]):
        def run(self, q, layer):
            return super().run(q, layer) * 0.5  # wrong numbers must fail the comparison

    bad = dict(REF_WRAPPERS, paged_decode=NoWindow)
    assert not run_text_demo(bad, "broken").ok
