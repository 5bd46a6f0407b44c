"""SnapshotStore: SWA snapshots in the engine's host memory.

Owns every stored snapshot; the store itself is owned by PrefixReuse (which
alone puts into it and sweeps it) and used on the engine thread only. Snapshots are frozen,
so one handed to a peer (FetchSwaSnapshot) cannot change under it.
A snapshot is the stored region of a slot (`state_size_to_disk` bytes: the
encoder SWA rings in the inference layout) at a block boundary S, keyed by
`snapshot_key(block_hash(S), layout_fingerprint)`. Bounded in bytes (LRU) and
by age (TTL in minutes); `clock` is injectable for tests.

A snapshot records the layout and model it came from; `get` refuses one that
does not match this engine (it is dropped, never restored). `on_put` and
`on_evict` tell the owner's observer (Engine: counters, directory) what
was stored and what went; they must not call back into the store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Snapshot:
    key: str
    position: int
    layout_fp: str
    model_fp: str
    data: bytes
    created: float


class SnapshotStore:
    def __init__(self, capacity_bytes: int, ttl_min: float, layout_fp: str, model_fp: str,
                 clock: Callable[[], float] = time.monotonic, on_evict=None, on_put=None):
        self.capacity = capacity_bytes
        self.ttl_s = ttl_min * 60.0
        self.layout_fp, self.model_fp = layout_fp, model_fp
        self.clock = clock
        self.on_evict = on_evict or (lambda key: None)   # e.g. withdraw from the directory
        self.on_put = on_put or (lambda snap: None)      # e.g. publish to the directory
        self._items: OrderedDict[str, Snapshot] = OrderedDict()
        self.bytes = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return self._fresh(key) is not None

    def put(self, snap: Snapshot) -> bool:
        if len(snap.data) > self.capacity:
            return False
        if snap.key in self._items:
            self._remove(snap.key, notify=False)
        self._items[snap.key] = snap
        self.bytes += len(snap.data)
        while self.bytes > self.capacity:
            self._remove(next(iter(self._items)))
        self.on_put(snap)
        return True

    def get(self, key: str) -> Snapshot | None:
        snap = self._fresh(key)
        if snap is None:
            return None
        if snap.layout_fp != self.layout_fp or snap.model_fp != self.model_fp:
            self.refused += 1
            self._remove(key)
            return None
        self._items.move_to_end(key)
        return snap

    def peek(self, key: str) -> Snapshot | None:
        """The snapshot under `key` for a peer (FetchSwaSnapshot), changing nothing: a peer's
        read does not make it recent here, and what `get` would drop stays for the engine's
        own next call to drop (the ranks of a split engine must hold the same store)."""
        snap = self._items.get(key)
        if snap is None or self.clock() - snap.created > self.ttl_s or \
                snap.layout_fp != self.layout_fp or snap.model_fp != self.model_fp:
            return None
        return snap

    def expire(self) -> int:
        old = [k for k, s in self._items.items() if self.clock() - s.created > self.ttl_s]
        for k in old:
            self._remove(k)
        return len(old)

    def keys(self) -> list[str]:
        return list(self._items)

    def items(self) -> list[tuple[str, Snapshot]]:
        """(key, snapshot) in LRU order, expired ones included until the next sweep."""
        return list(self._items.items())

    def _fresh(self, key: str) -> Snapshot | None:
        snap = self._items.get(key)
        if snap is not None and self.clock() - snap.created > self.ttl_s:
            self._remove(key)
            return None
        return snap

    def _remove(self, key: str, notify: bool = True) -> None:
        snap = self._items.pop(key)
        self.bytes -= len(snap.data)
        if notify:
            self.on_evict(key)
