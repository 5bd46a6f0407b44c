"""The durable tier: objects as 10+2 erasure-coded shards over 12 locations.

Stateless apart from the `ShardStore` it drives; the caller (`KvStore`) owns
metadata and decides which generation is current. Read path:

    fetch all 12 shards in parallel (dead locations answer None at once)
      -> ec.decode: drop shards failing checks or of another generation
      -> >= k healthy: data; < k: miss (NotEnoughShards -> None)
      -> missing/corrupt shards on reachable locations: re-encode, write back
         (only if `still_current()` says the object was not deleted meanwhile)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.errors import Unavailable
from services.kvstore import ec
from services.kvstore.shards import ShardStore

log = logging.getLogger("kvmesh.kvstore.durable")


@dataclass(frozen=True)
class ReadResult:
    data: bytes | None
    missing: frozenset[int] = frozenset()  # shard indexes that were absent or bad
    repaired: frozenset[int] = frozenset()  # of those, written back


class DurableStore:
    def __init__(self, layout: ec.Layout, shards: ShardStore, write_quorum: int):
        self.layout = layout
        self.shards = shards
        self.write_quorum = write_quorum

    async def _encode(self, key: str, generation: int, data: bytes) -> list[bytes]:
        # Encoding a 64 MiB object takes ~0.1 s: keep it off the event loop.
        return await asyncio.to_thread(ec.encode, self.layout, key, generation, data)

    async def put(self, key: str, generation: int, data: bytes) -> int:
        """Write all shards; Unavailable when fewer than `write_quorum` landed."""
        blobs = await self._encode(key, generation, data)
        ok = await asyncio.gather(*(self.shards.put(i, key, b) for i, b in enumerate(blobs)))
        stored = sum(ok)
        if stored < self.write_quorum:
            raise Unavailable(
                f"put {key}: only {stored} of {self.layout.n} shards stored "
                f"(need {self.write_quorum}); shard locations down"
            )
        return stored

    async def _fetch(self, key: str, indexes) -> dict[int, bytes | None]:
        got = await asyncio.gather(*(self.shards.get(i, key) for i in indexes))
        return dict(zip(indexes, got, strict=True))

    async def get(self, key: str, generation: int, repair: bool = True,
                  still_current: Callable[[], bool] = lambda: True,
                  full: bool = False) -> ReadResult:
        """Data shards first; parity only if one of them is missing or bad
        (saves m of n requests on the common path). `full` (scrub) checks all n."""
        k, n = self.layout.k, self.layout.n
        blobs = await self._fetch(key, list(range(n if full else k)))
        try:
            decoded = await asyncio.to_thread(ec.decode, self.layout, key, blobs, generation)
            if decoded.missing - set(range(k, n)) and not full:
                raise ec.NotEnoughShards("a data shard is missing")
        except ec.NotEnoughShards:
            decoded = None
        if decoded is None and not full:
            blobs.update(await self._fetch(key, list(range(k, n))))
        try:
            if decoded is None:
                decoded = await asyncio.to_thread(ec.decode, self.layout, key, blobs, generation)
        except ec.NotEnoughShards as exc:
            log.info("miss from durable tier: %s", exc)
            return ReadResult(None, frozenset(i for i, b in blobs.items() if b is None))
        if not full and len(blobs) == k:  # parity not fetched: not known to be missing
            decoded = ec.Decoded(decoded.data, decoded.generation, decoded.healthy,
                                 decoded.missing - set(range(k, n)))
        repaired: frozenset[int] = frozenset()
        if decoded.missing and repair:
            repaired = await self._repair(key, decoded, still_current)
        return ReadResult(decoded.data, decoded.missing, repaired)

    async def _repair(self, key: str, decoded: ec.Decoded,
                      still_current: Callable[[], bool]) -> frozenset[int]:
        targets = [i for i in sorted(decoded.missing) if self.shards.is_up(i)]
        if not targets:
            return frozenset()
        fresh = await asyncio.to_thread(ec.rebuild, self.layout, key, decoded, targets)
        # Checked after the slow part: a delete or GC meanwhile must not be undone.
        if not still_current():
            return frozenset()
        ok = await asyncio.gather(*(self.shards.put(i, key, fresh[i]) for i in targets))
        done = frozenset(i for i, good in zip(targets, ok, strict=True) if good)
        if done:
            log.info("repaired shards %s of %s", sorted(done), key)
        return done

    async def delete(self, key: str) -> int:
        """Best effort on every location; returns how many deletes succeeded.
        Shards left on dead locations are orphans for the GC sweep."""
        ok = await asyncio.gather(
            *(self.shards.delete(i, key, force=True) for i in range(self.layout.n))
        )
        return sum(ok)
