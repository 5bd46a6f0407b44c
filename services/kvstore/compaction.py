"""Compaction of mostly-dead runs (a `KvStore` mixin, run at the end of a GC pass).

A run whose live blocks hold less than `compact_live_fraction` of its payload and that
is older than `compact_min_age_s` (gc.compactable) is rewritten:

    read its live blocks (ranged GETs, digest-checked, as a Get does)
      -> write them as a new run (12 shard objects; each block keeps its generation,
         traffic class, created and last-access time, so TTL/LRU see no change)
      -> `meta.relocate`, one sqlite transaction or one Redis script: a block moves only
         if its record is still that generation in the old run (a delete or overwrite
         that came meanwhile wins; its copy in the new run is just dead weight)
      -> the old run has no live block left: reclaimed as any dead run (not while a
         reader of this process holds it; a reader on another replica gets a miss)

Readers never see other bytes: a block's generation and digest do not change, the old
run's shards stay until it is reclaimed, and run ids are never reused. A crash between
writing the new run and `relocate` leaves shards with no run row: orphans, swept by GC
after the grace.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import TYPE_CHECKING

from kvmesh.services.kvstore import ec, gc, runs
from kvmesh.services.kvstore.meta import Record, RunRecord
from kvmesh.services.kvstore.shards import RUN_PREFIX

if TYPE_CHECKING:
    from kvmesh.services.kvstore.core import KvStore

log = logging.getLogger("kvmesh.kvstore.compaction")


class CompactOps:
    async def compact_runs(self: KvStore, now: float, held=None) -> int:
        """Rewrite every compactable run; returns how many were compacted."""
        records = self.meta.items()
        table = {run: (info.created, info.size) for run, info in self.meta.runs.items()}
        todo = gc.compactable(records, table, now, self.cfg.compact_min_age_s,
                              self.cfg.compact_live_fraction)
        recs = dict(records)
        done = 0
        for run, keys in sorted(todo.items()):
            if held is not None:
                held.check()
            try:
                done += await self._compact_one(run, [(k, recs[k]) for k in keys])
            except Exception as exc:  # noqa: BLE001 - one run failing must not stop GC
                log.warning("compaction of run %s failed: %s", run, exc)
        return done

    async def _compact_one(self: KvStore, run: str, group: list[tuple[str, Record]]) -> int:
        info = self.meta.runs.get(run)
        if info is None:
            return 0
        with contextlib.ExitStack() as leases:
            for k, _ in group:
                leases.enter_context(self._lease(k, run))
            got = await self.runs.read(run, info, group, lambda: run in self.meta.runs)
        blocks = [(k, rec, got.blocks[k]) for k, rec in group if got.blocks.get(k) is not None]
        if not blocks:
            return 0
        new = secrets.token_hex(runs.RUN_ID_HEX // 2)
        now = self.clock()
        offsets = runs.layout_blocks([len(d) for _, _, d in blocks])
        payload = b"".join(d for _, _, d in blocks)
        entries = tuple(runs.BlockEntry(k, off, len(d), rec.generation, rec.traffic_class,
                                        rec.created, rec.digest or ec.digest(d))
                        for (k, rec, d), off in zip(blocks, offsets, strict=True))
        manifest = runs.Manifest(entries, await self._digest(payload))
        run_gen = secrets.randbits(63)
        blobs = await self.durable.encode(new, run_gen, payload, manifest.pack())
        frag_data, data_at = ec.fragment_data(self.cfg.layout, blobs[0])
        await self.durable.write(new, blobs, prefix=RUN_PREFIX)
        moved = self.meta.relocate(run, new, RunRecord(run_gen, len(payload), frag_data,
                                                       data_at, manifest.digest, now),
                                   [(k, rec, off) for (k, rec, _), off
                                    in zip(blocks, offsets, strict=True)])
        self.counters["runs_compacted"] += 1
        self.counters["compaction_blocks_moved"] += moved
        self.counters["compaction_bytes_rewritten"] += len(payload)
        await self._reclaim_runs()
        return 1
