"""Reading blocks out of runs (runs.py): ranged GETs first, a full decode when needed.

Stateless apart from the stores it drives; `KvStore` owns the index and the
leases and passes in what it read from them. One read of blocks of one run:

    fast path (every data shard touched is up and not slow):
      per data shard, ONE ranged GET of the bytes the wanted blocks occupy
      (runs.locate / merge_spans: a block up to F bytes is 1 or 2 GETs, a whole
      run 10) -> each block cut out and checked against its blake3 digest
    any GET missing/short/late or any digest wrong -> slow path for those blocks:
      DurableStore.get of the run object (hedged, parity, digest of the whole
      payload, repair of bad shards) -> the blocks sliced out, checked again

A ranged GET cannot check the shard's crc32 (it covers the whole object), so
the block digest is the check; a block that fails it is never served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from services.kvstore import ec, runs
from services.kvstore.durable import GIVE_UP_MIN_S, DurableStore, ReadResult
from services.kvstore.meta import Record, RunRecord
from services.kvstore.shards import RUN_PREFIX, ShardStore

log = logging.getLogger("kvmesh.kvstore.runs")
# Ranged reads are not hedged one by one: past max(floor, factor x the slowest
# budget) the whole fast path gives up and the hedged full read takes over.
FAST_FACTOR = 4.0


@dataclass
class RunRead:
    blocks: dict[str, bytes | None]  # key -> bytes, or None (a clean miss)
    slow: ReadResult | None = None  # the full decode, when the fast path was not enough
    fast_failed: int = 0  # blocks the fast path could not serve


class RunReader:
    def __init__(self, layout: ec.Layout, shards: ShardStore, durable: DurableStore):
        self.layout = layout
        self.shards = shards
        self.durable = durable

    async def read(self, run: str, info: RunRecord, wanted: list[tuple[str, Record]],
                   still_current: Callable[[], bool], repair: bool = True) -> RunRead:
        out = RunRead({})
        todo = wanted
        if self._fast_ok(info, wanted):
            got = await self._ranged(run, info, wanted)
            out.blocks.update({k: d for k, d in got.items() if d is not None})
            todo = [(k, r) for k, r in wanted if got.get(k) is None]
            out.fast_failed = len(todo)
        if not todo:
            return out
        res = await self.durable.get(run, info.generation, repair=repair,
                                     still_current=still_current, expect=info.digest,
                                     prefix=RUN_PREFIX)
        out.slow = res
        for key, rec in todo:
            data = None
            if res.data is not None:
                piece = res.data[rec.offset:rec.offset + rec.size]
                data = piece if _matches(piece, rec) else None
            out.blocks[key] = data
        return out

    def _fast_ok(self, info: RunRecord, wanted: list[tuple[str, Record]]) -> bool:
        touched = {s.shard for _, r in wanted
                   for s in runs.locate(r.offset, r.size, info.frag_data, self.layout.k)}
        return all(self.shards.is_up(i) and not self.shards.slow(i) for i in touched)

    async def _ranged(self, run: str, info: RunRecord,
                      wanted: list[tuple[str, Record]]) -> dict[str, bytes | None]:
        spans = {k: runs.locate(r.offset, r.size, info.frag_data, self.layout.k)
                 for k, r in wanted}
        ranges = runs.merge_spans([s for ss in spans.values() for s in ss])
        order = sorted(ranges)
        timeout = max(GIVE_UP_MIN_S / 4,
                      FAST_FACTOR * max((self.shards.budget(i) for i in order), default=0.0))
        tasks = [asyncio.ensure_future(self.shards.get(
            i, run, prefix=RUN_PREFIX,
            byte_range=(info.data_at + ranges[i][0], info.data_at + ranges[i][1])))
            for i in order]
        done, late = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        for t in late:
            t.cancel()
        bodies = {i: (t.result() if t in done else None) for i, t in zip(order, tasks, strict=True)}
        out: dict[str, bytes | None] = {}
        for key, rec in wanted:
            pieces = []
            for s in spans[key]:
                body = bodies[s.shard]
                lo = ranges[s.shard][0]
                pieces.append(None if body is None else body[s.start - lo:s.end - lo])
            if any(p is None for p in pieces):
                out[key] = None
                continue
            data = b"".join(pieces)  # type: ignore[arg-type]
            out[key] = data if _matches(data, rec) else None
            if out[key] is None:
                log.warning("run %s: block %s failed its digest on a ranged read", run, key)
        return out


def _matches(data: bytes, rec: Record) -> bool:
    """Exact size and, where recorded, the blake3 digest."""
    return len(data) == rec.size and (rec.digest is None or ec.digest(data) == rec.digest)
