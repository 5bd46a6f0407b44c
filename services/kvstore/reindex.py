"""Rebuild the index from the shard locations alone (`kvmesh admin reindex`).

Every format-2 shard carries its object's or run's manifest (runs.py), so the
index is a cache of what the locations already say. A reindex:

    list `blk/` and `run/` at every location (names seen anywhere)
      -> per name, ONE ranged GET of the head of one shard (the first location
         that answers with a head that passes its checks; the manifest has its
         own crc32), ~1 request per stored object or run
      -> `plan` (pure): every block entry becomes a committed record; a key
         found in several places keeps the newest (created time, then name)
      -> the caller (`KvStore.reindex`) adds what its index lacks or holds older

Format-1 objects (no manifest) come back with what their header says: size and
generation, traffic class chatbot, created = the shard's S3 modification time,
no digest (read unchecked, as before digests existed). Access times are not in
the manifests: a restored block counts as last used when it was written, so
TTL and LRU after a reindex are as strict as for a block never read since.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.services.kvstore import ec, runs
from kvmesh.services.kvstore.meta import Record, RunRecord
from kvmesh.services.kvstore.shards import PREFIX, RUN_PREFIX, LocationDown, ShardStore

log = logging.getLogger("kvmesh.kvstore.reindex")
HEAD_BYTES = 16 * 1024  # first guess of a head's size: 16 blocks' manifest is ~4 KB
DEFAULT_CLASS = "chatbot"


@dataclass(frozen=True)
class Found:
    """One stored object or run, as its head says."""

    name: str  # key (single object) or run id
    is_run: bool
    head: ec.Head
    modified: float  # newest S3 LastModified of its shards


@dataclass
class Restored:
    records: dict[str, Record] = field(default_factory=dict)
    runs: dict[str, RunRecord] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)  # no shard head passed its checks


async def scan(shards: ShardStore, layout: ec.Layout, progress: Callable[[str, int, int], None],
               concurrency: int = 16) -> tuple[list[Found], list[str]]:
    """(what every listed object or run says, names whose heads could not be read)."""
    seen: dict[tuple[str, bool], tuple[float, list[int]]] = {}
    for i in range(layout.n):
        for prefix, is_run in ((PREFIX, False), (RUN_PREFIX, True)):
            try:
                listed = await shards.list(i, prefix)
            except LocationDown:
                continue
            for s in listed:
                newest, where = seen.get((s.key, is_run), (0.0, []))
                seen[(s.key, is_run)] = (max(newest, s.modified), [*where, i])
    sem = asyncio.Semaphore(concurrency)
    found: list[Found] = []
    bad: list[str] = []
    done = 0

    async def one(name: str, is_run: bool, modified: float, where: list[int]) -> None:
        nonlocal done
        async with sem:
            head = await _read_head(shards, layout, name, is_run, where)
        if head is None:
            bad.append((RUN_PREFIX if is_run else PREFIX) + name)
        else:
            found.append(Found(name, is_run, head, modified))
        done += 1
        progress("reindex", done, len(seen))

    await asyncio.gather(*(one(n, r, m, w) for (n, r), (m, w) in seen.items()))
    return found, sorted(bad)


async def _read_head(shards: ShardStore, layout: ec.Layout, name: str, is_run: bool,
                     where: list[int]) -> ec.Head | None:
    prefix = RUN_PREFIX if is_run else PREFIX
    for i in where:
        want = HEAD_BYTES
        for _ in range(3):  # a longer manifest than guessed: read again, as long as it says
            blob = await shards.get(i, name, force=True, prefix=prefix, byte_range=(0, want))
            if blob is None:  # shorter than `want`, or not there: the whole object
                blob = await shards.get(i, name, force=True, prefix=prefix)
            if blob is None:
                break
            try:
                head = ec.parse_head(layout, blob)
            except ec.ShardError as exc:
                log.warning("reindex: shard %d of %s%s unusable: %s", i, prefix, name, exc)
                break
            if isinstance(head, ec.Head):
                if head.header.key == name and head.header.index == i:
                    return head
                break
            want = head
    return None


def plan(found: list[Found]) -> Restored:
    """Records and runs from what the heads say; the newest entry of a key wins."""
    out = Restored()
    order: dict[str, tuple[float, str]] = {}
    for f in sorted(found, key=lambda f: (f.is_run, f.name)):
        h = f.head.header
        entries: list[tuple[str, Record]] = []
        if h.version == ec.FORMAT_V1:
            if f.is_run:
                continue  # runs are never written in format 1
            entries.append((f.name, Record(h.generation, h.object_size, DEFAULT_CLASS,
                                           f.modified, f.modified, True, None)))
        else:
            try:
                manifest = runs.Manifest.unpack(h.manifest)
            except ValueError as exc:
                log.warning("reindex: %s: %s", f.name, exc)
                continue
            run = f.name if f.is_run else ""
            for b in manifest.blocks:
                if not f.is_run and b.key != f.name:
                    continue  # a single object names itself
                entries.append((b.key, Record(b.generation, b.size, b.traffic_class, b.created,
                                              b.created, True, b.digest, run, b.offset)))
            if f.is_run:
                out.runs[f.name] = RunRecord(h.generation, h.object_size, f.head.frag_data,
                                             f.head.data_at, manifest.digest,
                                             min((b.created for b in manifest.blocks),
                                                 default=f.modified))
        for key, rec in entries:
            rank = (rec.created, f.name)
            if key not in order or rank > order[key]:
                order[key] = rank
                out.records[key] = rec
    return out
