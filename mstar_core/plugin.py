"""The backend author's SDK: every name a plugin distribution imports from mstar, in one module.

    from mstar_core.plugin import BackendSpec, HeadDims, InputError, hookimpl

The compatibility promise (docs/PLUGINS.md, section 2): a name listed in ``__all__`` here keeps
working, with the same meaning, for every core of the same plugin API MAJOR (``API_VERSION``).
The modules these names are defined in are private and may move; import from here. The test kit
(``conformance_test`` and the tiny paged batch a warmup plans with) loads on first use of its names,
so a plugin's entry module, imported at discovery on every machine, does not build its case tables.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mstar_core.attention.calls import takes_plan_objects
from mstar_core.attention.checks import check_plan_kwargs, check_scale, check_sinks, check_soft_cap, refuse_sinks
from mstar_core.attention.plans import PagedPlan, RaggedPlan, WrapperSize, paged_plan, ragged_plan
from mstar_core.attention.protocols import (
    MixedWrapper,
    PagedDecodeWrapper,
    PagedPrefillWrapper,
    PrefixedPrefillWrapper,
)
from mstar_core.backends.varlen import (
    SUPPORTED_DTYPES,
    VarlenPrefixedWrapper,
    check_offsets,
    check_same_device,
    check_varlen_plan,
    host_int32,
)
from mstar_core.capabilities import BOUNDED, CAPABILITIES, MIXED, PAGED_DECODE, PAGED_PREFILL, PREFIXED_RAGGED
from mstar_core.errors import InputError, InputIndexError, InputTypeError, MstarError, StateError, Unsupported
from mstar_core.features import MAX_DECODE_QUERY_TOKENS
from mstar_core.first_use import first_use
from mstar_core.first_use import seen as first_use_seen
from mstar_core.registry.api import API_VERSION
from mstar_core.registry.device import device_arch, device_kind
from mstar_core.registry.hookspecs import hookimpl
from mstar_core.registry.measured import MeasuredTable, load_table
from mstar_core.registry.probing import installed_version, module_missing, version_too_old, version_tuple
from mstar_core.registry.spec import BackendSpec, CapabilitySpec, HeadDims, dtype_name
from mstar_core.step import check_window_and_scale, is_int
from mstar_core.warmup import WarmedKernel, WarmupConfig

if TYPE_CHECKING:
    from mstar_core.testing.check import conformance_test
    from mstar_core.testing.conformance import PagedCase, PagedData, make_paged

# Loaded on first access (PEP 562): the test kit builds its case tables on import.
_LAZY: dict[str, str] = {
    "conformance_test": "mstar_core.testing.check",
    "PagedCase": "mstar_core.testing.conformance",
    "PagedData": "mstar_core.testing.conformance",
    "make_paged": "mstar_core.testing.conformance",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    # the plugin API version this core implements (a spec's api_version is held to its MAJOR)
    "API_VERSION",
    # registering a backend
    "BackendSpec",
    "CapabilitySpec",
    "HeadDims",
    "hookimpl",
    # capability names (BackendSpec.provides keys)
    "BOUNDED",
    "CAPABILITIES",
    "MIXED",
    "PAGED_DECODE",
    "PAGED_PREFILL",
    "PREFIXED_RAGGED",
    # contract 2.0: what a wrapper is built for, and the plans the core builds and checks once
    "PagedPlan",
    "RaggedPlan",
    "WrapperSize",
    "paged_plan",
    "ragged_plan",
    "takes_plan_objects",
    # the wrapper protocols
    "MixedWrapper",
    "PagedDecodeWrapper",
    "PagedPrefillWrapper",
    "PrefixedPrefillWrapper",
    # the errors a wrapper or probe raises
    "InputError",
    "InputIndexError",
    "InputTypeError",
    "MstarError",
    "StateError",
    "Unsupported",
    # argument checks a wrapper's plan and run share
    "MAX_DECODE_QUERY_TOKENS",
    "check_plan_kwargs",
    "check_scale",
    "check_sinks",
    "check_soft_cap",
    "check_window_and_scale",
    "is_int",
    "refuse_sinks",
    # the flash_attn_varlen_func wrapper and its checks
    "SUPPORTED_DTYPES",
    "VarlenPrefixedWrapper",
    "check_offsets",
    "check_same_device",
    "check_varlen_plan",
    "host_int32",
    # probes
    "device_arch",
    "device_kind",
    "dtype_name",
    "installed_version",
    "module_missing",
    "version_too_old",
    "version_tuple",
    # measured kernel times (BackendSpec.measured)
    "MeasuredTable",
    "load_table",
    # warmup (BackendSpec.warmup) and first-use compiles
    "PagedCase",
    "PagedData",
    "WarmedKernel",
    "WarmupConfig",
    "first_use",
    "first_use_seen",
    "make_paged",
    # testing
    "conformance_test",
]
