"""Garbage-collection rules, as pure functions over metadata snapshots.

What goes, in this order:
  1. expired:  complete objects unused for longer than their class TTL
               (agent 3 days, chatbot 7 days by default);
  2. stale:    uploads that never completed (complete=0), older than the grace;
  3. evicted:  if the complete bytes left exceed high_watermark * capacity,
               least recently used objects (ties by key) until the total is at
               or below low_watermark * capacity;
  4. orphans:  shards on S3 with no record at all, last modified more than the
               grace ago but after this metadata database was created.

Keys being read right now (`busy`) are never chosen; they are counted as
skipped and looked at again next run. The executor is `KvStore.run_gc`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.services.kvstore.config import KvstoreConfig
from kvmesh.services.kvstore.meta import Record


@dataclass
class GcPlan:
    expired: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    skipped_busy: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    bytes_before: int = 0

    @property
    def victims(self) -> list[str]:
        return self.expired + self.stale + self.evicted


def plan(records: list[tuple[str, Record]], now: float, cfg: KvstoreConfig,
         busy: set[str] | frozenset[str] = frozenset()) -> GcPlan:
    out = GcPlan()
    survivors: list[tuple[float, str, int]] = []
    for key, rec in records:
        if rec.complete:
            out.bytes_before += rec.size
        if not rec.complete:
            due = now - rec.created > cfg.orphan_grace_s
            target = out.stale
        else:
            due = now - rec.last_access > cfg.ttl_s(rec.traffic_class)
            target = out.expired
        if not due:
            if rec.complete:
                survivors.append((rec.last_access, key, rec.size))
            continue
        if key in busy:
            out.skipped_busy.append(key)
            if rec.complete:
                survivors.append((rec.last_access, key, rec.size))
            continue
        target.append(key)
        out.bytes_freed += rec.size if rec.complete else 0
    total = sum(size for _, _, size in survivors)
    if total > cfg.high_watermark * cfg.capacity_bytes:
        goal = cfg.low_watermark * cfg.capacity_bytes
        for _, key, size in sorted(survivors):
            if total <= goal:
                break
            if key in busy:
                if key not in out.skipped_busy:
                    out.skipped_busy.append(key)
                continue
            out.evicted.append(key)
            out.bytes_freed += size
            total -= size
    for lst in (out.expired, out.stale, out.skipped_busy):
        lst.sort()
    return out


def find_orphans(listed: dict[str, float], known: set[str], now: float, grace_s: float,
                 db_created: float) -> list[str]:
    """Keys whose shards exist with no metadata record.

    `listed` maps key -> newest LastModified of its shards over all locations.
    Shards modified before the database existed are not ours to judge (the
    metadata was lost or belongs to another kvstore) and are left alone.
    """
    return sorted(
        key for key, modified in listed.items()
        if key not in known and now - modified > grace_s and modified >= db_created - 1.0
    )


def compactable(records: list[tuple[str, Record]], runs: dict[str, tuple[float, int]],
                now: float, min_age_s: float, max_live: float) -> dict[str, list[str]]:
    """Mostly-dead runs worth rewriting -> their live keys (sorted).

    `runs` maps run id -> (created, payload bytes). A run qualifies when it is older than
    `min_age_s`, all its blocks are committed (none being written) and its live blocks
    hold less than `max_live` of its payload. Blocks being read do not hold it back: a
    move changes neither their bytes nor their generation. A run with no live block is
    not compacted: it is reclaimed whole.
    """
    live: dict[str, list[tuple[str, int]]] = {}
    unsettled: set[str] = set()
    for key, rec in records:
        if not rec.run:
            continue
        if not rec.complete:
            unsettled.add(rec.run)
        else:
            live.setdefault(rec.run, []).append((key, rec.size))
    out: dict[str, list[str]] = {}
    for run, (created, size) in runs.items():
        blocks = live.get(run)
        if not blocks or run in unsettled or now - created < min_age_s:
            continue
        if sum(n for _, n in blocks) < max_live * size:
            out[run] = sorted(k for k, _ in blocks)
    return out
