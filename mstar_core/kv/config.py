"""Shape of a paged KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mstar_core.errors import InputError


@dataclass(frozen=True)
class KVConfig:
    """Paged cache geometry. ``num_qo_heads`` is the query heads sharing it: attention managers
    need the GQA ratio, and they receive this config (``kv_config``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_pages: int
    num_qo_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "max_pages"):
            if getattr(self, name) < 1:
                raise InputError(f"KVConfig.{name} must be >= 1, got {getattr(self, name)}")
        q = self.qo_heads
        if q < 1:
            raise InputError(f"KVConfig.num_qo_heads must be >= 1 (or None: as many as num_kv_heads), got {q}")
        if q % self.num_kv_heads:
            raise InputError(
                f"KVConfig: num_qo_heads ({q}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def qo_heads(self) -> int:
        return self.num_kv_heads if self.num_qo_heads is None else self.num_qo_heads

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``[num_layers, max_pages, 2, page_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, self.max_pages, 2, self.page_size, self.num_kv_heads, self.head_dim)

    def storage_bytes(self, itemsize: int) -> int:
        """Bytes of the storage :attr:`shape` holds at ``itemsize`` bytes an element: what a
        memory check weighs before the cache is allocated."""
        return math.prod(self.shape) * itemsize
