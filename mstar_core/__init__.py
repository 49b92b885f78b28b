"""mstar-core: attention resources and a plugin registry for kernel backends.

Every public name is importable from here (``from mstar_core import KVManager``); the modules
below are private and may move, but for ``mstar_core.plugin``: what a backend plugin imports. The
transformers integration and the plugin test kit load on first use of their names, so
``import mstar_core`` imports neither transformers nor the suite.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from mstar_core.attention.base import AttentionManager
from mstar_core.attention.dense import DenseAttentionManager, DensePlan, DenseSegment
from mstar_core.attention.grouped import GroupedPagedAttentionManager, GroupedPlan
from mstar_core.attention.groups import LayerGroup, layer_groups
from mstar_core.attention.paged import PagedAttentionManager, PagedAttnPlan, build_paged_attention
from mstar_core.attention.protocols import (
    MixedWrapper,
    PagedDecodeWrapper,
    PagedPrefillWrapper,
    PrefixedPrefillWrapper,
)
from mstar_core.compiling import CompiledForward, CompileOptions
from mstar_core.config import Config, load_config
from mstar_core.distributed import TensorParallel
from mstar_core.errors import (
    BackendUnavailable,
    CommitError,
    CompileError,
    ConfigError,
    InputError,
    InputIndexError,
    InputTypeError,
    MstarError,
    PluginError,
    StateError,
    TensorParallelError,
    UnknownName,
    Unsupported,
    UnsupportedModel,
)
from mstar_core.features import AttentionFeatures
from mstar_core.graphs import GraphRunner
from mstar_core.kernels.bounded_attention import bounded_attention
from mstar_core.kv import CacheStream, KVConfig, KVManager, KVPlan, LabelLayout, SpanLayout
from mstar_core.kv.bounded import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedPlan,
    BoundedStep,
    RowLayout,
    StreamPosition,
)
from mstar_core.node import Node, StepResult
from mstar_core.registry import (
    CAPABILITIES,
    BackendSpec,
    CapabilitySpec,
    HeadDims,
    Registry,
    Selection,
    get_registry,
    hookimpl,
    hookspec,
    reset_registry,
    select_backend,
)
from mstar_core.registry.dense import dense_or_flashinfer, dense_selection
from mstar_core.resource import BuildInfo, Resource
from mstar_core.sampling import Sampler, SamplingParams
from mstar_core.step import AdmitOutcome, AttentionStep, KVSpan, KVStep, Shortage, Step, StepContext
from mstar_core.warmup import WarmedKernel, WarmupConfig, WarmupReport, warmup

if TYPE_CHECKING:
    # probe from its own module: in the package the name is also a submodule's, which mypy reads as a redefinition.
    from mstar_core.integrations.transformers import Engine, EngineOptions, Generation, generate, generate_report
    from mstar_core.integrations.transformers.probe import probe
    from mstar_core.testing.check import check_backend, conformance_test

__version__ = "0.1.0"

# Loaded on first access (PEP 562): the transformers integration needs the `transformers` extra,
# and the plugin test kit builds its case tables on import.
_LAZY: dict[str, str] = {
    "Engine": "mstar_core.integrations.transformers",
    "EngineOptions": "mstar_core.integrations.transformers",
    "Generation": "mstar_core.integrations.transformers",
    "generate": "mstar_core.integrations.transformers",
    "generate_report": "mstar_core.integrations.transformers",
    "probe": "mstar_core.integrations.transformers",
    "check_backend": "mstar_core.testing.check",
    "conformance_test": "mstar_core.testing.check",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module.endswith(".transformers") and importlib.util.find_spec("transformers") is None:
        raise ImportError(f"mstar_core.{name} needs transformers: in a clone of mstar, pip install '.[transformers]' "
                          "(or pip install 'transformers>=5.17.0,<=5.24.0')")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CAPABILITIES",
    "AdmitOutcome",
    "AttentionFeatures",
    "AttentionManager",
    "AttentionStep",
    "BackendSpec",
    "BackendUnavailable",
    "BoundedKVConfig",
    "BoundedKVManager",
    "BoundedPlan",
    "BoundedStep",
    "BuildInfo",
    "CacheStream",
    "CommitError",
    "CompileError",
    "CompileOptions",
    "CompiledForward",
    "Config",
    "ConfigError",
    "DenseAttentionManager",
    "DensePlan",
    "DenseSegment",
    "Engine",
    "EngineOptions",
    "Generation",
    "GraphRunner",
    "GroupedPagedAttentionManager",
    "GroupedPlan",
    "CapabilitySpec",
    "HeadDims",
    "InputError",
    "InputIndexError",
    "InputTypeError",
    "KVConfig",
    "KVManager",
    "KVPlan",
    "KVSpan",
    "KVStep",
    "LabelLayout",
    "LayerGroup",
    "MixedWrapper",
    "MstarError",
    "Node",
    "PagedAttentionManager",
    "PagedAttnPlan",
    "PagedDecodeWrapper",
    "PagedPrefillWrapper",
    "PluginError",
    "PrefixedPrefillWrapper",
    "Registry",
    "Resource",
    "RowLayout",
    "Sampler",
    "SamplingParams",
    "Selection",
    "Shortage",
    "SpanLayout",
    "StateError",
    "Step",
    "StepContext",
    "StepResult",
    "StreamPosition",
    "TensorParallel",
    "TensorParallelError",
    "UnknownName",
    "Unsupported",
    "UnsupportedModel",
    "WarmedKernel",
    "WarmupConfig",
    "WarmupReport",
    "__version__",
    "bounded_attention",
    "build_paged_attention",
    "check_backend",
    "conformance_test",
    "dense_or_flashinfer",
    "dense_selection",
    "generate",
    "generate_report",
    "get_registry",
    "hookimpl",
    "hookspec",
    "layer_groups",
    "load_config",
    "probe",
    "reset_registry",
    "select_backend",
    "warmup",
]
