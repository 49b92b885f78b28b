"""The bounded KV manager (seed 004): per-request sink + window slots. See :mod:`.manager`."""

from .config import BoundedKVConfig, RowLayout
from .manager import BoundedKVManager
from .plan import BoundedPlan
from .positions import PART, BoundedStep, StreamPosition, bounded_part

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
