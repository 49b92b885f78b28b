"""KV managers: paged (``KVManager``) and bounded (sink + window ring)."""

from mstar_core.kv.config import KVConfig
from mstar_core.kv.paged import KVManager
from mstar_core.kv.plan import KVPlan, LabelLayout, SpanLayout
from mstar_core.kv.streams import CacheStream

__all__ = ["CacheStream", "KVConfig", "KVManager", "KVPlan", "LabelLayout", "SpanLayout"]
