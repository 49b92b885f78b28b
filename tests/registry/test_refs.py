"""``"module:attr"`` references, as a spec's provides, probe and measured name them."""

from __future__ import annotations

import os.path

import pytest

from mstar_core.errors import InputError
from mstar_core.registry.spec import load_ref


def test_a_reference_loads_its_module_and_dotted_attribute():
    assert load_ref("os.path:join") is os.path.join
    assert load_ref("os.path:join.__name__") == "join"


@pytest.mark.parametrize("ref", ["os.path", "os.path:", ":join", ":"])
def test_a_reference_without_module_colon_and_attribute_is_refused(ref):
    with pytest.raises(InputError, match=f"expected a 'module:attr' reference, got '{ref}'"):
        load_ref(ref)
