"""The denoise example end to end: through the reference (via main and the registry) and through
the FA3 and AITER wrappers over their stand-ins."""

from __future__ import annotations

import torch

from mstar_core.demo import denoise


def test_main_on_cpu_reports_ok(capsys):
    assert denoise.main() == 0
    out = capsys.readouterr().out
    assert "backend: reference" in out and "OK" in out
    assert "gathers (expected" in out


def test_counts_follow_the_events():
    s = denoise.DenoiseShape()
    rep = denoise.run_denoise(denoise_ref(), "reference", shape=s)
    assert rep.ok, rep.lines()
    # a and b on the first denoise step, the fork's c and its bumped source a, the reset b:
    # one gather per layer each
    assert rep.gathers == 5 * s.num_layers and rep.rebuilds == 2 * s.num_layers
    assert rep.hits > 0


def test_through_fa3_and_aiter_standins(fa3_standin, aiter_standin):
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper
    from mstar_rocm.ragged import AiterPrefixedPrefillWrapper

    for cls in (FA3PrefixedPrefillWrapper, AiterPrefixedPrefillWrapper):
        rep = denoise.run_denoise(cls, cls.__name__, dtype=torch.bfloat16)
        assert rep.ok, rep.lines()
    assert fa3_standin.CALLS > 0 and aiter_standin.CALLS > 0


def test_a_stale_cache_is_caught(monkeypatch):
    """If the manager ignored reset_request and the streams' generations, the example must fail."""
    from mstar_core.attention import dense as D
    from mstar_core.attention import prefix_cache as P

    monkeypatch.setattr(D.DenseAttentionManager, "reset_request", lambda self, rid, free=False: None)
    monkeypatch.setattr(P.GatheredPrefixCache, "validate",
                        lambda self, stream, key, shared=None: self._keys.setdefault(stream, key))
    s = denoise.DenoiseShape(reset=("b", 32))  # same length after the reset: only the generation differs
    rep = denoise.run_denoise(denoise_ref(), "reference", shape=s)
    assert not rep.ok and rep.max_error > 1e-2


def denoise_ref():
    from mstar_core.backends.reference import ReferencePrefixedPrefillWrapper

    return ReferencePrefixedPrefillWrapper
