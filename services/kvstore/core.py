"""KvStore: the transport-free core of the kvstore service.

Owns: the metadata store, both hot tiers, the durable store and the per-key
reader counts (`_readers`, the read leases GC respects). Only this class
changes any of them; the gRPC servicer converts messages and calls in here.

One Get, walked through:
  1. `meta.current(key)` -> committed record (generation g) or a miss;
  2. take a read lease on the key (GC will not pick it while held);
  3. memory tier (key, g) -> disk tier (key, g) -> durable tier (key, g),
     which decodes any 10 healthy shards and writes back missing ones;
  4. fill the tiers above the one that answered, note the access time
     (flushed to sqlite in batches), release the lease.

GC removes a victim's record and tier copies in one synchronous step (no
await in between), so a reader either got its lease first (GC skips the key)
or finds no record (a clean miss); shards are deleted only afterwards.

Runs (runs.py): a put of several blocks writes one run object per location;
a get groups its cold keys by run and reads each run once (runstore.py). A
run is reclaimed (`_reclaim_runs`) once none of its blocks has a record and
no reader holds a lease on it (`_run_readers`). Admin calls: admin.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from kvmesh.errors import Unavailable
from kvmesh.services.kvstore import ec, keys, runs
from kvmesh.services.kvstore.admin import AdminOps
from kvmesh.services.kvstore.compaction import CompactOps
from kvmesh.services.kvstore.config import KvstoreConfig
from kvmesh.services.kvstore.durable import DurableStore, ReadResult
from kvmesh.services.kvstore.index import open_index
from kvmesh.services.kvstore.meta import Record, RunRecord
from kvmesh.services.kvstore.runstore import RunReader
from kvmesh.services.kvstore.shards import RUN_PREFIX, ShardStore
from kvmesh.services.kvstore.tiers import DiskTier, MemoryTier

# What each GC pass adds to `counters` (run_gc); /metrics shows them from the start, at 0.
GC_COUNTERS = ("gc_runs", "gc_deleted", "gc_expired", "gc_evicted", "gc_orphans_removed",
               "gc_bytes_freed")
# What durable-tier reads add (`_count`): repairs, hedging, integrity; also shown from 0.
READ_COUNTERS = ("shards_repaired", "shard_reads_hedged", "shard_reads_timed_out",
                 "digest_mismatches_recovered", "shards_forged", "digest_mismatches_unrecovered")

log = logging.getLogger("kvmesh.kvstore")
class KvStore(AdminOps, CompactOps):
    def __init__(self, cfg: KvstoreConfig, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.clock = clock
        data = Path(cfg.data_dir)
        self.meta, self.lease = open_index(cfg, clock())  # index.py: sqlite or shared
        self.mem = MemoryTier(cfg.mem_bytes)
        self.disk = DiskTier(data / "blocks", cfg.disk_bytes)
        self.shards = ShardStore.from_config(cfg)
        self.durable = DurableStore(cfg.layout, self.shards, cfg.write_quorum,
                                    give_up_s=cfg.s3_give_up_s)
        self.runs = RunReader(cfg.layout, self.shards, self.durable)
        # S3 reads in flight (config.s3_reads_in_flight says why they are bounded); the
        # late deadlines of a read start when it holds a permit, not while it waits.
        self._s3_reads = asyncio.Semaphore(cfg.s3_reads_in_flight)
        self._readers: Counter[str] = Counter()
        self._run_readers: Counter[str] = Counter()  # a run being read is never reclaimed
        self.counters: Counter[str] = Counter()
        self._tasks: list[asyncio.Task] = []
        self._gc_lock = asyncio.Lock()

    # -- lifecycle --------------------------------------------------------------
    def start_background(self) -> None:
        """Periodic access-time flush and GC; call from inside the event loop."""
        self._tasks = [asyncio.create_task(self._every(self.cfg.access_flush_s, self._flush)),
                       asyncio.create_task(self._every(self.cfg.gc_interval_s, self._auto_gc))]

    async def _every(self, seconds: float, fn) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await fn()
            except Exception:  # noqa: BLE001 - a failed pass must not end the loop
                log.exception("background task %s failed", fn.__name__)

    async def _flush(self) -> None:
        self.meta.flush()

    async def _auto_gc(self) -> None:
        try:
            report = await self.run_gc(dry_run=False)
            log.info("gc: %s", report.summary())
        except Unavailable as exc:
            log.warning("gc skipped: %s", exc)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.meta.close()
        await self.shards.close()

    @contextmanager
    def _lease(self, key: str, run: str = ""):
        self._readers[key] += 1
        if run:
            self._run_readers[run] += 1
        try:
            yield
        finally:
            self._readers[key] -= 1
            if self._readers[key] <= 0:
                del self._readers[key]
            if run:
                self._run_readers[run] -= 1
                if self._run_readers[run] <= 0:
                    del self._run_readers[run]

    def busy(self) -> set[str]:
        return set(self._readers)

    # -- data path --------------------------------------------------------------
    def check_put(self, key: str, size: int, traffic_class: str) -> str:
        keys.check_key(key)
        keys.check_size(key, size, self.cfg.max_object_bytes)
        return keys.check_traffic_class(traffic_class)

    async def put(self, items: list[tuple[str, bytes]], traffic_class: str = "") -> int:
        """Store every object durably (and in the hot tiers). All or error."""
        return await self.put_objects([(k, d, traffic_class) for k, d in items])

    async def put_objects(self, items: list[tuple[str, bytes, str]]) -> int:
        """Like `put`, with a traffic class per object. Two or more objects are stored
        as runs (runs.py) of up to `run_blocks`; a later duplicate key wins."""
        checked = [(k, bytes(d), self.check_put(k, len(d), tc)) for k, d, tc in items]
        unique = list({k: (k, d, tc) for k, d, tc in checked}.values())
        # An empty block would touch no shard in a run, so its reads could not tell a
        # lost run from a healthy one: it stays an object of its own.
        packed = [i for i, (_, d, _) in enumerate(unique) if d]
        groups = [[packed[j] for j in g] for g in runs.split_batches(
            [len(unique[i][1]) for i in packed], self.cfg.run_blocks, self.cfg.run_max_bytes)]
        groups += [[i] for i, (_, d, _) in enumerate(unique) if not d]
        await asyncio.gather(*(
            self._put_run([unique[i] for i in g]) if len(g) > 1 else self._put_one(*unique[g[0]])
            for g in groups))
        await self._reclaim_runs()  # runs whose last block these puts overwrote
        return len(checked)

    @staticmethod
    async def _digest(data: bytes) -> bytes:
        # blake3 releases the GIL: a 64 MiB object's digest must not stall the loop.
        return ec.digest(data) if len(data) < 1 << 20 else await asyncio.to_thread(ec.digest, data)

    async def _put_one(self, key: str, data: bytes, traffic_class: str) -> None:
        gen = secrets.randbits(63)
        digest = await self._digest(data)
        now = self.clock()
        manifest = runs.Manifest((runs.BlockEntry(key, 0, len(data), gen, traffic_class, now,
                                                  digest),), digest)
        self.mem.drop(key)
        self.disk.drop(key)
        self.meta.begin_put(key, gen, len(data), traffic_class, now, digest)
        try:
            await self.durable.put(key, gen, data, manifest.pack())
        except BaseException:
            if self.meta.remove(key, gen) is not None:
                asyncio.ensure_future(self.durable.delete(key))
            raise
        if self.meta.commit_put(key, gen):
            self.counters["puts"] += 1
            self.mem.put(key, gen, data)
            await self.disk.put(key, gen, data)

    async def _put_run(self, items: list[tuple[str, bytes, str]]) -> None:
        """One run: index rows (complete=0) first, then 12 shard objects, then commit."""
        run_id = secrets.token_hex(runs.RUN_ID_HEX // 2)
        now = self.clock()
        offsets = runs.layout_blocks([len(d) for _, d, _ in items])
        payload = b"".join(d for _, d, _ in items)
        digests = [await self._digest(d) for _, d, _ in items]
        entries = tuple(runs.BlockEntry(k, off, len(d), secrets.randbits(63), tc, now, dg)
                        for (k, d, tc), off, dg in zip(items, offsets, digests, strict=True))
        manifest = runs.Manifest(entries, await self._digest(payload))
        run_gen = secrets.randbits(63)
        blobs = await self.durable.encode(run_id, run_gen, payload, manifest.pack())
        frag_data, data_at = ec.fragment_data(self.cfg.layout, blobs[0])
        info = RunRecord(run_gen, len(payload), frag_data, data_at, manifest.digest, now)
        for e in entries:
            self.mem.drop(e.key)
            self.disk.drop(e.key)
        self.meta.begin_run(run_id, info, [
            (e.key, Record(e.generation, e.size, e.traffic_class, now, now, False, e.digest,
                           run_id, e.offset)) for e in entries])
        try:
            await self.durable.write(run_id, blobs, prefix=RUN_PREFIX)
        except BaseException:
            self.meta.abort_run(run_id, [(e.key, e.generation) for e in entries])
            asyncio.ensure_future(self._reclaim_runs())
            raise
        done = set(self.meta.commit_run(run_id, [(e.key, e.generation) for e in entries]))
        self.counters["puts"] += len(done)
        self.counters["runs_written"] += 1
        for (key, data, _), e in zip(items, entries, strict=True):
            if key in done:
                self.mem.put(key, e.generation, data)
                await self.disk.put(key, e.generation, data)

    async def _reclaim_runs(self) -> int:
        """Delete the shards of runs whose last block is gone (not while one is read)."""
        # drop_run is True for exactly one caller (replicas sharing the index race here)
        dead = [r for r in list(self.meta.dead_runs)
                if r not in self._run_readers and self.meta.drop_run(r)]
        await asyncio.gather(*(self.durable.delete(r, prefix=RUN_PREFIX) for r in dead))
        self.counters["runs_reclaimed"] += len(dead)
        return len(dead)

    async def get(self, key_list: list[str]) -> list[bytes | None]:
        """Hot tiers first; the rest from S3, blocks of one run in one run read."""
        keys.check_keys(key_list)
        recs = self.meta.current_many(list(dict.fromkeys(key_list)))
        found: dict[str, bytes | None] = {}
        with contextlib.ExitStack() as leases:
            for k, r in recs.items():  # no await since meta.current: GC cannot have struck
                leases.enter_context(self._lease(k, r.run))
            cold: dict[str, list[tuple[str, Record]]] = {}
            for k, r in recs.items():
                found[k] = data = await self._hot(k, r.generation)
                if data is None:
                    cold.setdefault(r.run, []).append((k, r))
            singles = [(k, r) for k, r in cold.pop("", [])]
            await asyncio.gather(*(self._get_cold(k, r, found) for k, r in singles),
                                 *(self._get_run(run, group, found) for run, group in cold.items()))
        now = self.clock()
        out = [found.get(k) for k in key_list]
        for k, data in zip(key_list, out, strict=True):
            if data is None:
                self.counters["misses"] += 1
            else:
                self.meta.touch(k, now)
        return out

    async def _hot(self, key: str, gen: int) -> bytes | None:
        data = self.mem.get(key, gen)
        if data is not None:
            self.counters["hits_mem"] += 1
            return data
        data = await self.disk.get(key, gen)
        if data is not None:
            self.counters["hits_disk"] += 1
            self.mem.put(key, gen, data)
        return data

    async def _fill(self, key: str, gen: int, data: bytes) -> None:
        await self._fill_many([(key, gen, data)])

    async def _fill_many(self, got: list[tuple[str, int, bytes]]) -> None:
        """Hot-tier copies of what S3 served, for the blocks still current (one index
        read for all: a round trip each would add up on the shared index)."""
        self.counters["hits_s3"] += len(got)
        if not got or (self.mem.capacity == 0 and self.disk.capacity == 0):
            return
        cur = self.meta.current_many([k for k, _, _ in got])
        for key, gen, data in got:
            if (rec := cur.get(key)) is not None and rec.generation == gen:
                self.mem.put(key, gen, data)
                await self.disk.put(key, gen, data)

    async def _get_cold(self, key: str, rec: Record, found: dict[str, bytes | None]) -> None:
        gen = rec.generation
        async with self._s3_reads:
            res = await self.durable.get(key, gen,
                                         still_current=lambda: self._is_current(key, gen),
                                         expect=rec.digest)
        self._count(res)
        found[key] = res.data
        if res.data is not None:
            await self._fill(key, gen, res.data)

    async def _get_run(self, run: str, group: list[tuple[str, Record]],
                       found: dict[str, bytes | None]) -> None:
        info = self.meta.runs.get(run)
        if info is None:  # cannot happen while its blocks are leased; a miss if it did
            return
        async with self._s3_reads:
            got = await self.runs.read(run, info, group, lambda: run in self.meta.runs)
        self.counters["run_reads"] += 1
        self.counters["run_blocks_ranged"] += len(group) - got.fast_failed
        self.counters["run_ranged_late"] += got.late
        if got.slow is not None:
            self._count(got.slow)
            self.counters["run_reads_decoded"] += 1
        for key, _ in group:
            found[key] = got.blocks.get(key)
        await self._fill_many([(k, rec.generation, d) for k, rec in group
                               if (d := got.blocks.get(k)) is not None])

    def _count(self, res: ReadResult) -> None:
        """Integrity and hedging counters (Stats.counters, `kvmesh admin gc stats`)."""
        self.counters["shards_repaired"] += len(res.repaired)
        self.counters["shard_reads_hedged"] += res.hedged
        self.counters["shard_reads_timed_out"] += len(res.timed_out)
        if res.forged:
            self.counters["digest_mismatches_recovered"] += 1
            self.counters["shards_forged"] += len(res.forged)
        if res.digest_miss:
            self.counters["digest_mismatches_unrecovered"] += 1

    def _is_current(self, key: str, gen: int) -> bool:
        rec = self.meta.current(key)
        return rec is not None and rec.generation == gen

    async def lookup(self, key_list: list[str]) -> int:
        """Length of the longest prefix of `key_list` that can be read now."""
        keys.check_keys(key_list)
        durable_ok = self.shards.up_count() >= self.cfg.layout.k
        now = self.clock()
        n = 0
        recs = self.meta.current_many(list(dict.fromkeys(key_list)))  # one round trip
        for key in key_list:
            rec = recs.get(key)
            if rec is None:
                break
            hot = self.mem.get(key, rec.generation) is not None or key in self.disk._index
            if not (hot or durable_ok):
                break
            self.meta.touch(key, now)
            n += 1
        return n

    async def delete(self, key_list: list[str]) -> int:
        keys.check_keys(key_list)
        gone = [(k, rec) for k in key_list if (rec := self._forget(k)) is not None]
        await asyncio.gather(*(self.durable.delete(k) for k, rec in gone if not rec.run))
        await self._reclaim_runs()
        return len(gone)

    def _forget(self, key: str, generation: int | None = None) -> Record | None:
        """Make the object invisible at once (record, tier copies); synchronous."""
        rec = self.meta.remove(key, generation)
        if rec is not None:
            self.mem.drop(key)
            self.disk.drop(key)
        return rec
