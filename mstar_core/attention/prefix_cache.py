"""The dense path's gathered-prefix cache: each stream's frozen prefix K/V, copied out of the
pages once per (stream, layer) and reused across steps.

An entry belongs to an *owner*, one per layer:

- a stream, for its own prefix: valid for the *stream key* ``(generation, prefix_len, pages)``
  (and the shared key below, which says where its own part starts); a generation bump (fork,
  reset, page-table move), a longer prefix, different pages or another shared key drop all of
  the stream's own layers at once;
- a *shared key* ``(node, tokens, pages)``: the leading full pages a stream holds from the KV
  manager's prefix cache (``node``: the node id its last one is keyed under), whose K/V any
  stream with the same shared key reads. The stream's own entry then holds only the rest of its
  prefix (none where the shared pages cover it).

Which shared key a stream has is the caller's to say (the dense manager checks it against the
prefix cache, see ``DenseAttentionManager``); here a shared entry lives while some stream uses
it: dropping a request, or a stream's key moving elsewhere, drops a shared entry only when no
other stream uses it any more (the others keep hitting it). Optionally bounded by
``max_tokens`` (prefix tokens summed over entries, a shared entry counted once), least recently
used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar_core.errors import InputError

StreamId = tuple[str, str]  # (request_id, label)
StreamKey = tuple[int, int, tuple[int, ...]]  # (generation, prefix_len, pages)
SharedKey = tuple[int, int, tuple[int, ...]]  # (node, tokens, pages): a stream's leading cached pages
Owner = StreamId | SharedKey  # a stream's own entries, or a shared key's: never equal (str vs int first)
KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PrefixCacheStats:
    """Counters, per (owner, layer) entry: a stream with a shared and an own part reads two
    entries per layer."""

    hits: int = 0
    gathers: int = 0  # misses: first use, or rebuilt after an invalidation or eviction
    invalidations: int = 0  # entries dropped because their stream's key moved (a shared one: its last user's)
    evictions: int = 0  # entries dropped by the LRU bound
    dropped: int = 0  # entries dropped by reset/remove/clear (a shared one: with its last user)


class GatheredPrefixCache:
    def __init__(self, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 0:
            raise InputError(f"max_tokens must be >= 0 or None, got {max_tokens}")
        self.max_tokens = max_tokens
        self.stats = PrefixCacheStats()
        self._keys: dict[StreamId, StreamKey] = {}  # the key a stream's own layers hold for
        self._shared_of: dict[StreamId, SharedKey] = {}  # the shared key a stream uses, if any
        self._users: dict[SharedKey, set[StreamId]] = {}  # the streams using each shared key
        self._layers: dict[Owner, set[int]] = {}
        self._entries: OrderedDict[tuple[Owner, int], KV] = OrderedDict()
        self._sizes: dict[tuple[Owner, int], int] = {}  # prefix tokens of each entry
        self.tokens = 0

    def streams(self) -> set[StreamId]:
        """Streams with a cached layer: of their own, or of the shared key they use."""
        out = {s for s in self._keys if self._layers.get(s)}
        out.update(s for s, sh in self._shared_of.items() if self._layers.get(sh))
        return out

    def shared(self) -> dict[SharedKey, set[StreamId]]:
        """The shared keys with a cached layer, and the streams using each."""
        return {sh: set(users) for sh, users in self._users.items() if self._layers.get(sh)}

    def validate(self, stream: StreamId, key: StreamKey, shared: SharedKey | None = None) -> None:
        """Drop ``stream``'s own layers if they were gathered under another key or shared key
        (O(layers)); move it to ``shared`` (None: its whole prefix is its own)."""
        old = self._keys.get(stream)
        old_shared = self._shared_of.get(stream)
        moved = old_shared is not shared and old_shared != shared
        if old is not None and (moved or old != key):
            self._drop_owner(stream, "invalidations")
        if moved:
            if old_shared is not None:
                self._release(stream, old_shared, "invalidations")
            if shared is not None:
                self._shared_of[stream] = shared
                self._users.setdefault(shared, set()).add(stream)
        self._keys[stream] = key

    def get(self, stream: StreamId, layer: int, key: StreamKey, gather: Callable[[], KV],
            shared: SharedKey | None = None) -> KV:
        """The stream's own prefix K/V at ``layer`` (with ``shared``: the part after the shared
        pages), gathering it on a miss."""
        self.validate(stream, key, shared)
        return self._get(stream, layer, key[1] - (shared[1] if shared is not None else 0), gather)

    def get_shared(self, stream: StreamId, layer: int, key: StreamKey, shared: SharedKey,
                   gather: Callable[[], KV]) -> KV:
        """The K/V of ``stream``'s shared pages at ``layer``, gathering it on a miss (once for
        every stream using ``shared``)."""
        self.validate(stream, key, shared)
        return self._get(shared, layer, shared[1], gather)

    def drop_request(self, rid: str) -> None:
        """Drop ``rid``'s own entries; its streams stop using their shared keys, whose entries go
        only with their last user (other streams still using one keep hitting it)."""
        for stream in [s for s in self._keys if s[0] == rid]:
            self._drop_owner(stream, "dropped")
            shared = self._shared_of.get(stream)
            if shared is not None:
                self._release(stream, shared, "dropped")
            del self._keys[stream]

    def clear(self) -> None:
        for owner in list(self._layers):
            self._drop_owner(owner, "dropped")
        self._keys.clear()
        self._shared_of.clear()
        self._users.clear()

    def _get(self, owner: Owner, layer: int, tokens: int, gather: Callable[[], KV]) -> KV:
        ek = (owner, layer)
        hit = self._entries.get(ek)
        if hit is not None:
            self._entries.move_to_end(ek)
            self.stats.hits += 1
            return hit
        kv = gather()
        self.stats.gathers += 1
        self._entries[ek] = kv
        self._sizes[ek] = tokens
        self._layers.setdefault(owner, set()).add(layer)
        self.tokens += tokens
        self._evict(keep=ek)
        return kv

    def _release(self, stream: StreamId, shared: SharedKey, counter: str) -> None:
        """``stream`` no longer uses ``shared``: its entries go with its last user."""
        del self._shared_of[stream]
        users = self._users[shared]
        users.discard(stream)
        if not users:
            del self._users[shared]
            self._drop_owner(shared, counter)

    def _drop_owner(self, owner: Owner, counter: str) -> None:
        for layer in self._layers.pop(owner, set()):
            self._remove((owner, layer))
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _remove(self, ek: tuple[Owner, int]) -> None:
        del self._entries[ek]
        self.tokens -= self._sizes.pop(ek)

    def _evict(self, keep: tuple[Owner, int]) -> None:
        if self.max_tokens is None:
            return
        while self.tokens > self.max_tokens:
            victim = next((ek for ek in self._entries if ek != keep), None)
            if victim is None:
                return  # the entry in use alone exceeds the bound: keep it for this layer
            owner, layer = victim
            self._remove(victim)
            self._layers[owner].discard(layer)
            self.stats.evictions += 1
