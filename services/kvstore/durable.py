"""The durable tier: objects as 10+2 erasure-coded shards over 12 locations.

Stateless apart from the `ShardStore` it drives; the caller (`KvStore`) owns
metadata and decides which generation is current. Read path (`get`):

    read the 10 data shards in parallel (locations that are down: skipped,
    their place taken by parity at once; one trial read per retry period)
      -> each answer is checked as it arrives (crc, key, index, generation)
      -> a missing/bad shard, or one later than its location's latency budget
         (hedge), starts a read of the next parity shard; a late read is not
         waited for once k good shards are in (decode from the first k good)
      -> ec.decode, checked against the recorded digest; on a mismatch all
         shards are read and other k-subsets tried; still no match: a miss
      -> missing/corrupt/forged shards are re-encoded and written back
         (only if `still_current()` says the object was not deleted meanwhile)

Scrub (`full`) reads all n shards, also from locations marked down, and
counts a shard that does not arrive within max(give_up_s, 8 x budget) as bad (timed
out); its repair writes to every location, down or not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.errors import Unavailable
from kvmesh.services.kvstore import ec
from kvmesh.services.kvstore.shards import PREFIX, ShardStore

log = logging.getLogger("kvmesh.kvstore.durable")
# With nothing left to start, a late read is awaited max(give_up_s, GIVE_UP_FACTOR x its
# budget) from its start, then counted as timed out: a hung location must not hold a get
# for the 5 s socket timeout (more: reads queue behind its 4 hung connections).
# give_up_s is the config's s3_give_up_s.
GIVE_UP_FACTOR = 8


@dataclass(frozen=True)
class ReadResult:
    data: bytes | None
    missing: frozenset[int] = frozenset()  # shard indexes that were absent or bad
    repaired: frozenset[int] = frozenset()  # of those, written back
    forged: frozenset[int] = frozenset()  # passed crc checks, disagreed with the digest
    digest_miss: bool = False  # enough shards, none of their k-subsets matched the digest
    hedged: int = 0  # late shard reads replaced by another shard
    timed_out: frozenset[int] = frozenset()  # never answered in time (counted in missing)


@dataclass
class _Gathered:
    blobs: dict[int, bytes | None]
    good: int = 0
    hedged: int = 0
    timed_out: frozenset[int] = frozenset()  # started, no answer in time (cancelled)
    launched: set[int] = field(default_factory=set)
    answered: set[int] = field(default_factory=set)  # the location replied (any reply)
    skipped: frozenset[int] = frozenset()  # location down, not read


class DurableStore:
    def __init__(self, layout: ec.Layout, shards: ShardStore, write_quorum: int,
                 put_grace_s: float = 1.0, give_up_s: float = 2.0):
        self.layout = layout
        self.shards = shards
        self.write_quorum = write_quorum
        self.put_grace_s = put_grace_s
        self.give_up_s = give_up_s
        self._background: set[asyncio.Future] = set()  # late shard reads left to finish

    async def encode(self, key: str, generation: int, data: bytes,
                     manifest: bytes | None = None) -> list[bytes]:
        # Encoding a 64 MiB object takes ~0.1 s: keep it off the event loop.
        return await asyncio.to_thread(ec.encode, self.layout, key, generation, data, manifest)

    async def put(self, key: str, generation: int, data: bytes,
                  manifest: bytes | None = None) -> int:
        """Encode and write all shards of a single object (`write`)."""
        return await self.write(key, await self.encode(key, generation, data, manifest))

    async def write(self, key: str, blobs: list[bytes], prefix: str = PREFIX) -> int:
        """Write all shards; Unavailable when fewer than `write_quorum` landed.

        Once the quorum has landed the stragglers get max(`put_grace_s`, 2 x the
        time the quorum took) more (a hung location must not hold every put for
        the 5 s timeout, a merely busy one should land); a shard that lands
        later is still the right one, one that never does is repaired by the
        next read or scrub."""
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(self.shards.put(i, key, b, prefix=prefix))
                 for i, b in enumerate(blobs)]
        pending = set(tasks)
        stored = 0
        grace_until = None
        while pending:
            timeout = None if grace_until is None else max(0.0, grace_until - time.monotonic())
            done, pending = await asyncio.wait(pending, timeout=timeout,
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            stored += sum(t.result() for t in done)
            if stored >= self.write_quorum and grace_until is None:
                now = time.monotonic()
                grace_until = now + max(self.put_grace_s, 2 * (now - t0))
            if stored + len(pending) < self.write_quorum:
                break
        if stored < self.write_quorum:
            raise Unavailable(
                f"put {key}: only {stored} of {self.layout.n} shards stored "
                f"(need {self.write_quorum}); shard locations down"
            )
        return stored

    def _check(self, key: str, i: int, blob: bytes | None, generation: int | None) -> bool:
        if blob is None:
            return False
        try:
            head, _ = ec.parse(self.layout, blob, key=key, index=i)
        except ec.ShardError:
            return False
        return generation is None or head.generation == generation

    async def _gather(self, key: str, generation: int | None, want: int,
                      order: list[int], full: bool = False, prefix: str = PREFIX) -> _Gathered:
        """Read shards in `order` until `want` good ones are in, hedging late ones.

        Locations with a read already late are put last (parity is read instead
        of waiting on them again). A late read is never cancelled: it runs to
        its answer or socket timeout in the background, so the location's
        health sees the real outcome. When nothing else can complete the set,
        late reads are awaited up to `max(give_up_s, 8 x budget)` (slow beats a
        miss), then counted as timed out."""
        readable = [i for i in order if full or self.shards.readable(i)]
        queue = [i for i in readable if not self.shards.slow(i)]
        queue += [i for i in readable if i not in queue]
        out = _Gathered({i: None for i in order}, skipped=frozenset(order) - set(readable))
        pending: dict[asyncio.Future, int] = {}
        started: dict[int, float] = {}
        late: set[int] = set()
        timed_out: set[int] = set()

        def launch() -> None:
            i = queue.pop(0)
            started[i] = time.monotonic()
            out.launched.add(i)
            pending[asyncio.ensure_future(self.shards.get(i, key, force=True, prefix=prefix))] = i

        def deadline(i: int) -> float:
            budget = self.shards.budget(i)
            if i not in late:
                return started[i] + budget
            return started[i] + max(self.give_up_s, GIVE_UP_FACTOR * budget)

        try:
            while True:
                active = sum(1 for i in pending.values() if i not in late)
                while queue and out.good + active < want:
                    launch()
                    active += 1
                if not pending or out.good >= want:
                    break
                wake = min(deadline(i) for i in pending.values())
                done, _ = await asyncio.wait(list(pending), timeout=max(0.0, wake - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    blob = None if task.exception() is not None else task.result()
                    if task.exception() is None:
                        out.answered.add(i)
                    if self._check(key, i, blob, generation):
                        out.blobs[i] = blob
                        out.good += 1
                now = time.monotonic()
                for task, i in list(pending.items()):
                    if now < deadline(i):
                        continue
                    if i in late:  # given up on
                        pending.pop(task)
                        timed_out.add(i)
                        self._keep(task)
                    else:
                        late.add(i)
                        out.hedged += 1
        finally:
            for task, i in pending.items():
                if i in late:
                    self._keep(task)
                else:
                    task.cancel()  # an unneeded read still on time: nothing learned by waiting
        out.timed_out = frozenset(timed_out | (late & set(pending.values())))
        return out

    def _keep(self, task: asyncio.Future) -> None:
        """Let a late read finish in the background (its outcome feeds health)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def get(self, key: str, generation: int | None, repair: bool = True,
                  still_current: Callable[[], bool] = lambda: True,
                  full: bool = False, expect: bytes | None = None,
                  prefix: str = PREFIX) -> ReadResult:
        """The object, or data=None (a clean miss). Data shards first; parity only
        for shards that are missing, bad or late. `full` (scrub) checks all n.
        `expect`: the digest recorded at put time. `prefix`: runs are `run/` objects."""
        k, n = self.layout.k, self.layout.n
        got = await self._gather(key, generation, n if full else k, list(range(n)), full=full,
                                 prefix=prefix)
        blobs = got.blobs
        try:
            decoded = await asyncio.to_thread(ec.decode, self.layout, key, blobs, generation,
                                              expect, full)
        except ec.DigestMismatch as exc:
            log.warning("digest mismatch, trying other shard sets: %s", exc)
            # every shard without an answer in hand: never read, and read but late, failed
            # or given up on (under load a hedged gather leaves some), may complete a set
            # that matches; one that answered is what it is
            rest = [i for i in range(n) if i not in got.answered]
            if rest:
                more = await self._gather(key, generation, len(rest), rest, prefix=prefix)
                blobs.update({i: b for i, b in more.blobs.items() if b is not None})
                got.launched |= more.launched
                got.timed_out |= more.timed_out
            try:
                decoded = await asyncio.to_thread(ec.decode, self.layout, key, blobs,
                                                  generation, expect)
            except ec.NotEnoughShards as exc2:
                log.error("miss from durable tier: %s", exc2)
                return self._miss(got, digest_miss=isinstance(exc2, ec.DigestMismatch))
        except ec.NotEnoughShards as exc:
            log.info("miss from durable tier: %s", exc)
            return self._miss(got)
        missing = decoded.missing
        if not full:  # parity never read (not needed) is not known to be missing
            missing = missing & (got.launched | {i for i in got.skipped if i < k})
        repaired: frozenset[int] = frozenset()
        if missing and repair:
            # The data path writes back only where the location just answered this
            # read (a 404 or a bad shard): one that is down, hung or was not asked
            # could hold the get for a write timeout. Scrub (`full`) tries every location.
            targets = missing if full else frozenset(missing & got.answered)
            repaired = await self._repair(key, decoded, targets, still_current, prefix)
        return ReadResult(decoded.data, frozenset(missing), repaired, decoded.forged, False,
                          got.hedged, got.timed_out)

    @staticmethod
    def _miss(got: _Gathered, digest_miss: bool = False) -> ReadResult:
        return ReadResult(None, frozenset(i for i, b in got.blobs.items() if b is None),
                          digest_miss=digest_miss, hedged=got.hedged, timed_out=got.timed_out)

    async def _repair(self, key: str, decoded: ec.Decoded, targets: frozenset[int],
                      still_current: Callable[[], bool], prefix: str = PREFIX) -> frozenset[int]:
        order = sorted(targets)
        if not order:
            return frozenset()
        fresh = await asyncio.to_thread(ec.rebuild, self.layout, key, decoded, order)
        # Checked after the slow part: a delete or GC meanwhile must not be undone.
        if not still_current():
            return frozenset()
        ok = await asyncio.gather(*(self.shards.put(i, key, fresh[i], force=True, prefix=prefix)
                                    for i in order))
        done = frozenset(i for i, good in zip(order, ok, strict=True) if good)
        if done:
            log.info("repaired shards %s of %s", sorted(done), key)
        return done

    async def delete(self, key: str, prefix: str = PREFIX) -> int:
        """Best effort on every location; returns how many deletes succeeded.
        Shards left on dead locations are orphans for the GC sweep."""
        ok = await asyncio.gather(
            *(self.shards.delete(i, key, force=True, prefix=prefix) for i in range(self.layout.n))
        )
        return sum(ok)
