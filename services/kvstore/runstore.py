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

from kvmesh.services.kvstore import ec, runs
from kvmesh.services.kvstore.durable import GIVE_UP_FACTOR, DurableStore, ReadResult
from kvmesh.services.kvstore.meta import Record, RunRecord
from kvmesh.services.kvstore.shards import RUN_PREFIX, ShardStore

log = logging.getLogger("kvmesh.kvstore.runs")
# Ranged reads are not hedged one by one: the fast path waits as long as a get waits
# for a late shard (max(give_up_s, 8 x the slowest budget)), then the hedged full read
# takes over. A shorter wait (0.5 s was tried) turned queueing under load (16 prefix
# reads = 160 ranged GETs in flight) into decodes of whole runs: twice the requests.
# A location already hung or down is not read by the fast path at all (`_fast_ok`).


@dataclass
class RunRead:
    blocks: dict[str, bytes | None]  # key -> bytes, or None (a clean miss)
    slow: ReadResult | None = None  # the full decode, when the fast path was not enough
    fast_failed: int = 0  # blocks the fast path could not serve
    late: int = 0  # ranged GETs not in by the fast path's deadline (a loaded or hung location)


class RunReader:
    def __init__(self, layout: ec.Layout, shards: ShardStore, durable: DurableStore):
        self.layout = layout
        self.shards = shards
        self.durable = durable

    async def read(self, run: str, info: RunRecord, wanted: list[tuple[str, Record]],
                   still_current: Callable[[], bool], repair: bool = True) -> RunRead:
        out = RunRead({})
        spans = {k: runs.locate(r.offset, r.size, info.frag_data, self.layout.k)
                 for k, r in wanted}
        ranges = runs.merge_spans([s for ss in spans.values() for s in ss])
        reads: dict[int, asyncio.Future] = {}
        if self._fast_ok(ranges):
            reads = self._ranged(run, info, ranges)
            timeout = max(self.durable.give_up_s, GIVE_UP_FACTOR * max(
                (self.shards.budget(i) for i in ranges), default=0.0))
            if reads:
                await asyncio.wait(list(reads.values()), timeout=timeout)
        todo = self._assemble(run, wanted, spans, ranges, reads, out)
        out.fast_failed = len(todo)
        if not todo:
            return out
        # Hedge: decode the run from any 10 shards while late ranged reads go on; a
        # ranged read that lands still serves its blocks if decoding fails (< k up).
        slow = asyncio.ensure_future(self.durable.get(
            run, info.generation, repair=repair, still_current=still_current,
            expect=info.digest, prefix=RUN_PREFIX))
        late = [t for t in reads.values() if not t.done()]
        out.late = len(late)
        try:
            res = await slow
            if res.data is None and late:
                await asyncio.wait(late, timeout=self.durable.give_up_s)
                todo = self._assemble(run, todo, spans, ranges, reads, out)
        finally:
            for t in late:
                t.cancel()
        out.slow = res
        for key, rec in todo:
            data = None
            if res.data is not None:
                piece = res.data[rec.offset:rec.offset + rec.size]
                data = piece if _matches(piece, rec) else None
            out.blocks[key] = data
        return out

    def _fast_ok(self, ranges: dict[int, tuple[int, int]]) -> bool:
        return all(self.shards.is_up(i) and not self.shards.slow(i) for i in ranges)

    def _ranged(self, run: str, info: RunRecord,
                ranges: dict[int, tuple[int, int]]) -> dict[int, asyncio.Future]:
        """One ranged GET per data shard touched, started now."""
        return {i: asyncio.ensure_future(self.shards.get(
            i, run, prefix=RUN_PREFIX, byte_range=(info.data_at + lo, info.data_at + hi)))
            for i, (lo, hi) in sorted(ranges.items())}

    @staticmethod
    def _assemble(run: str, wanted: list[tuple[str, Record]], spans: dict[str, list[runs.Span]],
                  ranges: dict[int, tuple[int, int]], reads: dict[int, asyncio.Future],
                  out: RunRead) -> list[tuple[str, Record]]:
        """Cut the blocks whose ranged reads are in and check their digests into `out`;
        returns the blocks still to read."""
        todo = []
        for key, rec in wanted:
            pieces = []
            for s in spans[key]:
                t = reads.get(s.shard)
                ok = t is not None and t.done() and not t.cancelled() and t.exception() is None
                body = t.result() if ok else None  # type: ignore[union-attr]
                lo = ranges[s.shard][0]
                pieces.append(None if body is None else body[s.start - lo:s.end - lo])
            data = None if any(p is None for p in pieces) else b"".join(pieces)  # type: ignore[arg-type]
            if data is not None and not _matches(data, rec):
                log.warning("run %s: block %s failed its digest on a ranged read", run, key)
                data = None
            if data is None:
                todo.append((key, rec))
            else:
                out.blocks[key] = data
        return todo


def _matches(data: bytes, rec: Record) -> bool:
    """Exact size and, where recorded, the blake3 digest."""
    return len(data) == rec.size and (rec.digest is None or ec.digest(data) == rec.digest)
