"""The dense path's gathered-prefix cache: each stream's frozen prefix K/V, copied out of the
pages once per (stream, layer) and reused across steps.

An entry is valid for one *stream key* ``(generation, prefix_len, pages)``: a generation bump
(fork, reset, page-table move), a longer prefix or different pages drop all of the stream's
layers at once. Optionally bounded by ``max_tokens`` (prefix tokens summed over entries),
least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar_core.errors import InputError

StreamId = tuple[str, str]  # (request_id, label)
StreamKey = tuple[int, int, tuple[int, ...]]  # (generation, prefix_len, pages)


@dataclass
class PrefixCacheStats:
    """Counters, per (stream, layer) entry."""

    hits: int = 0
    gathers: int = 0  # misses: first use, or rebuilt after an invalidation or eviction
    invalidations: int = 0  # entries dropped because their stream's key moved
    evictions: int = 0  # entries dropped by the LRU bound
    dropped: int = 0  # entries dropped by reset/remove/clear


class GatheredPrefixCache:
    def __init__(self, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 0:
            raise InputError(f"max_tokens must be >= 0 or None, got {max_tokens}")
        self.max_tokens = max_tokens
        self.stats = PrefixCacheStats()
        self._keys: dict[StreamId, StreamKey] = {}  # the key a stream's cached layers hold for
        self._layers: dict[StreamId, set[int]] = {}
        self._entries: OrderedDict[tuple[StreamId, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.tokens = 0

    def streams(self) -> set[StreamId]:
        return {s for s, layers in self._layers.items() if layers}

    def validate(self, stream: StreamId, key: StreamKey) -> None:
        """Drop ``stream``'s layers if they were gathered under another key (O(layers))."""
        old = self._keys.get(stream)
        if old is not None and old != key:
            self._drop_stream(stream, "invalidations")
        self._keys[stream] = key

    def get(self, stream: StreamId, layer: int, key: StreamKey,
            gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream's prefix K/V at ``layer``, gathering it on a miss."""
        self.validate(stream, key)
        ek = (stream, layer)
        hit = self._entries.get(ek)
        if hit is not None:
            self._entries.move_to_end(ek)
            self.stats.hits += 1
            return hit
        kv = gather()
        self.stats.gathers += 1
        self._entries[ek] = kv
        self._layers.setdefault(stream, set()).add(layer)
        self.tokens += key[1]
        self._evict(keep=ek)
        return kv

    def drop_request(self, rid: str) -> None:
        for stream in [s for s in self._keys if s[0] == rid]:
            self._drop_stream(stream, "dropped")
            del self._keys[stream]

    def clear(self) -> None:
        for stream in list(self._keys):
            self._drop_stream(stream, "dropped")
        self._keys.clear()

    def _drop_stream(self, stream: StreamId, counter: str) -> None:
        n = self._keys[stream][1]
        for layer in self._layers.pop(stream, set()):
            del self._entries[(stream, layer)]
            self.tokens -= n
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _evict(self, keep: tuple[StreamId, int]) -> None:
        if self.max_tokens is None:
            return
        while self.tokens > self.max_tokens:
            victim = next((ek for ek in self._entries if ek != keep), None)
            if victim is None:
                return  # the entry in use alone exceeds the bound: keep it for this layer
            stream, layer = victim
            del self._entries[victim]
            self._layers[stream].discard(layer)
            self.tokens -= self._keys[stream][1]
            self.stats.evictions += 1
