"""Plain result types returned by `KvStore` admin calls (no gRPC here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.services.kvstore.durable import ReadResult
from kvmesh.services.kvstore.gc import GcPlan
from kvmesh.services.kvstore.meta import Record


@dataclass
class Stats:
    objects: int
    bytes: int
    pending: int
    objects_by_class: dict[str, int]
    bytes_by_class: dict[str, int]
    mem_objects: int
    mem_bytes: int
    mem_capacity: int
    disk_objects: int
    disk_bytes: int
    disk_capacity: int
    capacity_bytes: int
    high_watermark: float
    low_watermark: float
    locations: list[str]
    locations_up: list[bool]
    counters: dict[str, int]


@dataclass(frozen=True)
class ListEntry:
    key: str
    size: int
    traffic_class: str
    created: float
    last_access: float
    complete: bool

    @classmethod
    def of(cls, key: str, rec: Record) -> ListEntry:
        return cls(key, rec.size, rec.traffic_class, rec.created, rec.last_access, rec.complete)


@dataclass
class GcReport:
    dry_run: bool
    expired: list[str]
    stale: list[str]
    evicted: list[str]
    orphans: list[str]
    skipped_busy: list[str]
    bytes_freed: int
    bytes_before: int

    @classmethod
    def of(cls, plan: GcPlan, orphans: list[str], dry_run: bool) -> GcReport:
        return cls(dry_run, list(plan.expired), list(plan.stale), list(plan.evicted),
                   list(orphans), list(plan.skipped_busy), plan.bytes_freed, plan.bytes_before)

    def drop_kept(self, kept: set[str], sizes: dict[str, int]) -> None:
        """After a real run: planned victims a reader (or a re-put) saved are
        reported as skipped, so the lists say exactly what was removed."""
        for lst in (self.expired, self.stale, self.evicted):
            gone = [k for k in lst if k in kept]
            for k in gone:
                lst.remove(k)
                self.bytes_freed -= sizes.get(k, 0) if lst is not self.stale else 0
        self.skipped_busy = sorted(set(self.skipped_busy) | kept)

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        return (f"{verb} {len(self.expired)} expired, {len(self.evicted)} evicted (LRU), "
                f"{len(self.stale)} stale uploads, {len(self.orphans)} orphans; "
                f"{self.bytes_freed} bytes; {len(self.skipped_busy)} busy skipped")


@dataclass
class ScrubReport:
    repair: bool
    objects: int = 0
    healthy: int = 0
    degraded: list[str] = field(default_factory=list)  # readable, some shards bad/missing
    lost: list[str] = field(default_factory=list)  # fewer than k healthy shards
    shards_bad: int = 0
    shards_repaired: int = 0

    def add(self, key: str, res: ReadResult) -> None:
        self.objects += 1
        if res.data is None:
            self.lost.append(key)
        elif res.missing:
            self.degraded.append(key)
        else:
            self.healthy += 1
        self.shards_bad += len(res.missing)
        self.shards_repaired += len(res.repaired)


@dataclass
class ReindexReport:
    objects: int  # single objects found
    runs: int
    blocks_found: int  # distinct keys the manifests name
    restored: int  # records added or replaced
    unreadable: list[str]
