"""A third-party paged backend for the layer-group tests: every paged capability (reference
wrappers that count their runs and record what they are handed, :mod:`.plan_spies`), declaring
soft-cap and nothing else, so ``auto`` takes it for layers without sink logits (before the
reference) and the reference for the others; and for a model with several windows only per
uniform-window group (it lacks ``layer_windows``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from mstar_core.backends import reference as R

from .plan_spies import SPIES, clear, spy

FAKE = "fastpaged"
RUNS: dict[str, int] = {}


def _counting(base: type, kind: str) -> type:
    name = f"Fast{base.__name__.removeprefix('Reference')}"
    spied = spy(base, f"Spy{name}")

    def run(self, *args, **kw):
        RUNS[kind] = RUNS.get(kind, 0) + 1
        return spied.run(self, *args, **kw)

    return type(name, (spied,), {"run": run})


WRAPPERS = {
    "paged_prefill": _counting(R.ReferencePrefillWrapper, "paged_prefill"),
    "paged_decode": _counting(R.ReferenceDecodeWrapper, "paged_decode"),
    "mixed": _counting(R.ReferenceMixedWrapper, "mixed"),
}


def install_group_backend(fake_module, monkeypatch, features: tuple[str, ...] = ("soft_cap",),
                          spied_reference: bool = False) -> None:
    """``fastpaged`` (declaring ``features`` on every paged capability) beside the reference
    (``spied_reference``: its paged wrappers the spies), as the process-wide registry; its run
    counts and the spies' records restart empty."""
    from mstar_core import BackendSpec, Registry
    from mstar_core.backends.reference.plugin import REFERENCE

    fake_module(f"{FAKE}_mstar", **{cls.__name__: cls for cls in WRAPPERS.values()})
    reference = REFERENCE
    if spied_reference:
        fake_module("spied_reference_mstar", **{cls.__name__: cls for cls in SPIES.values()})
        reference = replace(REFERENCE, provides={**REFERENCE.provides, **{
            c: f"spied_reference_mstar:{cls.__name__}" for c, cls in SPIES.items()}})
    reg = Registry(discover=False)
    reg.register(reference, distribution="mstar-core", version="0")
    reg.register(BackendSpec(name=FAKE, provides={c: f"{FAKE}_mstar:{w.__name__}" for c, w in WRAPPERS.items()},
                             devices=("cpu",), dtypes=(torch.float32, torch.float64), api_version="1.1",
                             features=dict.fromkeys(WRAPPERS, features)),
                 distribution=f"{FAKE}-mstar", version="0.1")
    monkeypatch.setattr("mstar_core.registry.registry._default", reg)
    monkeypatch.delenv("MSTAR_ATTENTION_BACKEND", raising=False)
    RUNS.clear()
    clear()
