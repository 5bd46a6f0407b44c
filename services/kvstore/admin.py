"""Admin operations of `KvStore`: stats, list, GC, scrub, reindex.

A mixin, only to keep core.py readable: these run as `KvStore` methods, on the
state `KvStore` owns (meta, tiers, leases, counters); nothing here holds state
of its own. GC and scrub follow the rules in gc.py and the README; reindex the
flow in reindex.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.errors import InvalidArgument, Unavailable
from kvmesh.services.kvstore import gc, reindex
from kvmesh.services.kvstore.reports import GcReport, ListEntry, ReindexReport, ScrubReport, Stats
from kvmesh.services.kvstore.shards import PREFIX, RUN_PREFIX, LocationDown

if TYPE_CHECKING:
    from kvmesh.services.kvstore.core import KvStore

Progress = Callable[[str, int, int], None]  # (phase, done, total)


def _no_progress(phase: str, done: int, total: int) -> None:
    pass


class AdminOps:
    async def require_durable(self: KvStore) -> list[bool]:
        up = await self.shards.probe()
        if sum(up) < self.cfg.layout.k:
            raise Unavailable(
                f"only {sum(up)} of {len(up)} shard locations reachable "
                f"(need {self.cfg.layout.k}): S3 is down"
            )
        return up

    async def stats(self: KvStore) -> Stats:
        up = await self.require_durable()
        by_class: Counter[str] = Counter()
        bytes_by_class: Counter[str] = Counter()
        pending = 0
        for _, rec in self.meta.items():
            if not rec.complete:
                pending += 1
                continue
            by_class[rec.traffic_class] += 1
            bytes_by_class[rec.traffic_class] += rec.size
        return Stats(
            objects=sum(by_class.values()), bytes=self.meta.complete_bytes, pending=pending,
            objects_by_class=dict(by_class), bytes_by_class=dict(bytes_by_class),
            mem_objects=len(self.mem), mem_bytes=self.mem.used, mem_capacity=self.mem.capacity,
            disk_objects=len(self.disk), disk_bytes=self.disk.used,
            disk_capacity=self.disk.capacity, capacity_bytes=self.cfg.capacity_bytes,
            high_watermark=self.cfg.high_watermark, low_watermark=self.cfg.low_watermark,
            locations=[str(loc) for loc in self.cfg.locations], locations_up=up,
            counters=dict(self.counters)
            | {f"s3_requests_{kind}": n for kind, n in self.shards.requests.items()},
        )

    async def list(self: KvStore, start_after: str = "", limit: int = 1000) -> tuple[list[ListEntry], str]:
        """One page of objects in key order; the second value is the next page token."""
        if limit <= 0 or limit > 10_000:
            raise InvalidArgument(f"limit {limit} outside 1..10000")
        await self.require_durable()
        recs = dict(self.meta.items())  # one read of the index (shared: one round trip)
        page = sorted(k for k in recs if k > start_after)[: limit + 1]
        out = [ListEntry.of(k, recs[k]) for k in page[:limit]]
        return out, (page[limit - 1] if len(page) > limit else "")

    async def run_gc(self: KvStore, dry_run: bool = False, progress: Progress = _no_progress) -> GcReport:
        """One GC pass (gc.py rules). With a shared index, under the maintenance lease
        (lease.py): a pass while another replica holds it is UNAVAILABLE, naming it."""
        async with self._gc_lock:
            await self.require_durable()
            if dry_run:
                return await self._gc_pass(True, progress, None)
            async with self.lease.hold("gc") as held:
                return await self._gc_pass(False, progress, held)

    async def _gc_pass(self: KvStore, dry_run: bool, progress: Progress, held) -> GcReport:
        now = self.clock()
        snapshot = dict(self.meta.items())
        the_plan = gc.plan(list(snapshot.items()), now, self.cfg, self.busy())
        # Generations as planned: a key re-put while we list (here or by another replica
        # sharing the index) must not be hit.
        gens = {k: snapshot[k].generation for k in the_plan.victims}
        orphans = await self._orphans(now)
        report = GcReport.of(the_plan, orphans, dry_run)
        if dry_run:
            return report
        held.check()  # listing the locations can take seconds under load
        victims = the_plan.victims
        total = len(victims) + len(orphans)
        kept: set[str] = set()
        # overwrites pending since a putter died (shared index): their runs go dead
        self.meta.sweep_pending(now - self.cfg.orphan_grace_s)
        for done, key in enumerate(victims, 1):
            held.check()
            # Recheck at the moment of removal: a reader may have arrived.
            rec = None if key in self._readers else self._forget(key, gens[key])
            if rec is None:
                kept.add(key)
            elif not rec.run:  # a run's shards go when its last block has gone
                await self.durable.delete(key)
            progress("delete", done, total)
        report.drop_kept(kept, {k: snapshot[k].size for k in kept})
        await self._reclaim_runs()
        for done, name in enumerate(orphans, len(victims) + 1):
            held.check()
            if name.startswith(RUN_PREFIX):
                if name[len(RUN_PREFIX):] not in self.meta.runs:
                    await self.durable.delete(name[len(RUN_PREFIX):], prefix=RUN_PREFIX)
            elif self.meta.get(name) is None:
                await self.durable.delete(name)
            progress("orphans", done, total)
        if self.cfg.compact_live_fraction > 0:  # mostly-dead runs (compaction.py)
            await self.compact_runs(now, held)
        self.counters["gc_runs"] += 1
        self.counters["gc_deleted"] += len(victims) - len(kept)
        self.counters["gc_expired"] += len(report.expired)
        self.counters["gc_evicted"] += len(report.evicted)
        self.counters["gc_orphans_removed"] += len(orphans)
        self.counters["gc_bytes_freed"] += report.bytes_freed
        return report

    async def _orphans(self: KvStore, now: float) -> list[str]:
        """Single objects by key, runs as `run/<id>`: shards with no index entry."""
        newest: dict[str, float] = {}
        for i in range(self.cfg.layout.n):
            for prefix, tag in ((PREFIX, ""), (RUN_PREFIX, RUN_PREFIX)):
                try:
                    listed = await self.shards.list(i, prefix)
                except LocationDown:
                    continue  # its orphans wait for the next run
                for shard in listed:
                    name = tag + shard.key
                    newest[name] = max(newest.get(name, 0.0), shard.modified)
        known = {k for k, _ in self.meta.items()} | {RUN_PREFIX + r for r in self.meta.runs}
        return gc.find_orphans(newest, known, now, self.cfg.orphan_grace_s, self.meta.created)

    async def scrub(self: KvStore, repair: bool = False, progress: Progress = _no_progress,
                    concurrency: int = 4) -> ScrubReport:
        """Read every committed object's shards; with `repair`, rewrite bad ones."""
        await self.require_durable()
        report = ScrubReport(repair=repair)
        todo = sorted((k, r.generation, r.digest) for k, r in self.meta.items()
                      if r.complete and not r.run)
        todo += sorted((RUN_PREFIX + run, r.generation, r.digest) for run, r in self.meta.runs.items()
                       if self.meta.live_blocks(run) > 0)
        sem = asyncio.Semaphore(concurrency)
        done = 0

        async def one(name: str, gen: int, expect: bytes | None) -> None:
            nonlocal done
            is_run = name.startswith(RUN_PREFIX)
            key, prefix = (name[len(RUN_PREFIX):], RUN_PREFIX) if is_run else (name, PREFIX)
            current = ((lambda: key in self.meta.runs) if is_run
                       else (lambda: self._is_current(key, gen)))
            async with sem:
                with self._lease(name, key if is_run else ""):
                    res = await self.durable.get(key, gen, repair=repair, full=True,
                                                 still_current=current, expect=expect,
                                                 prefix=prefix)
            report.add(name, res)
            self._count(res)
            done += 1
            progress("scrub", done, len(todo))

        if repair:  # rewrites shards: one runner at a time across replicas
            async with self.lease.hold("scrub --repair"):
                await asyncio.gather(*(one(k, g, d) for k, g, d in todo))
        else:
            await asyncio.gather(*(one(k, g, d) for k, g, d in todo))
        return report

    async def reindex(self: KvStore, progress: Progress = _no_progress) -> ReindexReport:
        """Add what the locations' manifests hold and the index lacks (reindex.py)."""
        await self.require_durable()
        async with self.lease.hold("reindex"):
            return await self._reindex(progress)

    async def _reindex(self: KvStore, progress: Progress) -> ReindexReport:
        found, bad = await reindex.scan(self.shards, self.cfg.layout, progress)
        restored = reindex.plan(found)
        for run, info in restored.runs.items():
            if run not in self.meta.runs:
                self.meta.add_run(run, info)
        added = 0
        for key, rec in restored.records.items():
            cur = self.meta.get(key)
            if (cur is not None and cur.created >= rec.created) or key in self._readers:
                continue
            self.mem.drop(key)
            self.disk.drop(key)
            self.meta.restore(key, rec)
            added += 1
        self.meta.find_dead_runs()
        await self._reclaim_runs()  # runs all of whose blocks are held newer elsewhere
        self.counters["reindex_restored"] += added
        return ReindexReport(sum(not f.is_run for f in found), len(restored.runs),
                             len(restored.records), added, bad)
