"""mstar-core: attention resources and a plugin registry for kernel backends."""

import importlib.util
import warnings

if importlib.util.find_spec("numpy") is None:
    # torch warns at import when numpy is absent; mstar-core never hands torch numpy arrays,
    # so in a core-only install the warning is noise on every `mstar` command. Only that one
    # message is silenced, and only when numpy really is missing.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from mstar_core.resource import BuildInfo, Resource
from mstar_core.step import AdmitOutcome, AttentionStep, KVSpan, KVStep, Shortage, Step, StepContext

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
