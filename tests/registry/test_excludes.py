"""Feature combinations a capability does not run together (BackendSpec.excludes): declared
beside the features, refused by selection with a reason naming the combination, and never asked
by the kit; each feature alone is still served."""

from __future__ import annotations

import pytest
import torch

from mstar_core import AttentionFeatures, select_backend
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.capabilities import PAGED
from mstar_core.errors import InputError
from mstar_core.registry import BackendSpec, Registry
from mstar_core.testing import conformance as C
from mstar_flashinfer.plugin import FLASHINFER

F32 = torch.float32


def spec(**kw):
    return BackendSpec(name="combo", provides={c: REFERENCE.provides[c] for c in PAGED}, devices=("cpu",),
                       dtypes=(F32,), features=dict.fromkeys(PAGED, ("soft_cap", "sink_logits")),
                       api_version="1.1", priority=9, **kw)


def pick(reg, features):
    return select_backend(capabilities=PAGED, requested="auto", device="cpu", dtype=F32, head_dim=64,
                          registry=reg, honor_env=False, features=features)


def test_a_combination_is_refused_and_each_feature_alone_served():
    reg = Registry(discover=False)
    reg.register(REFERENCE)
    reg.register(spec(excludes={"paged_decode": (("sink_logits", "soft_cap"),)}))
    assert pick(reg, AttentionFeatures(sink_logits=True)).name == "combo"
    assert pick(reg, AttentionFeatures(soft_cap=5.0)).name == "combo"
    sel = pick(reg, AttentionFeatures(sink_logits=True, soft_cap=5.0))
    assert sel.names == {"paged_prefill": "combo", "paged_decode": "reference", "mixed": "combo"}
    assert sel.rejected["combo"] == ["does not support features sink_logits with soft_cap together in paged_decode"]


@pytest.mark.parametrize("excludes,match", [
    ({"bounded": (("soft_cap", "sink_logits"),)}, "names 'bounded', which it does not provide"),
    ({"paged_decode": (("soft_cap",),)}, "tuples of two or more feature names"),
    ({"paged_decode": ("soft_cap",)}, "tuples of two or more feature names"),
    ({"paged_decode": (("soft_cap", "fp8_e4m3"),)}, r"names \['fp8_e4m3'\], which features\['paged_decode'\]"),
])
def test_bad_declarations_are_refused_naming_them(excludes, match):
    with pytest.raises(InputError, match=match):
        spec(excludes=excludes)
    with pytest.raises(InputError, match="excludes came with plugin API 1.1"):
        BackendSpec(name="old", provides={"paged_decode": "m:c"},
                    features={"paged_decode": ("soft_cap", "sink_logits")},
                    excludes={"paged_decode": (("soft_cap", "sink_logits"),)})


def test_the_kit_does_not_ask_for_an_excluded_combination():
    every = C.feature_cases("decode", FLASHINFER.supports("paged_decode"))
    kept = C.feature_cases("decode", FLASHINFER.supports("paged_decode"),
                           excludes=FLASHINFER.excludes["paged_decode"])
    assert any(c.sinks and (c.soft_cap or c.kv_dtype != "auto") for c in every)
    assert not any(c.sinks and (c.soft_cap or c.kv_dtype != "auto") for c in kept)
    assert any(c.sinks for c in kept) and any(c.soft_cap for c in kept) and any(c.kv_dtype != "auto" for c in kept)
