"""KV managers: paged (``KVManager``) and bounded (sink + window ring)."""

from .config import KVConfig
from .paged import KVManager
from .plan import KVPlan, LabelLayout, SpanLayout
from .streams import CacheStream

__all__ = ["CacheStream", "KVConfig", "KVManager", "KVPlan", "LabelLayout", "SpanLayout"]
