"""The bounded KV manager: per-request sink + window slots. See :mod:`.manager`."""

from mstar_core.kv.bounded.config import BoundedKVConfig, RowLayout
from mstar_core.kv.bounded.manager import BoundedKVManager
from mstar_core.kv.bounded.plan import BoundedPlan
from mstar_core.kv.bounded.positions import PART, BoundedStep, StreamPosition, bounded_part

__all__ = [
    "PART",
    "BoundedKVConfig",
    "BoundedKVManager",
    "BoundedPlan",
    "BoundedStep",
    "RowLayout",
    "StreamPosition",
    "bounded_part",
]
