"""mstar-core: attention resources and a plugin registry for kernel backends."""

from .resource import BuildInfo, Resource
from .step import AdmitOutcome, AttentionStep, KVSpan, KVStep, Shortage, Step, StepContext

__version__ = "0.1.0"

__all__ = [
    "AdmitOutcome",
    "AttentionStep",
    "BuildInfo",
    "KVSpan",
    "KVStep",
    "Resource",
    "Shortage",
    "Step",
    "StepContext",
    "__version__",
]
