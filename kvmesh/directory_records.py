"""Value types of the directory, shared by core, servicer and client (no I/O, no gRPC).

All are immutable: whoever receives one may keep it.
"""

from __future__ import annotations

from typing import NamedTuple


class Entry(NamedTuple):
    """A snapshot an engine announces it holds."""

    key: str              # lowercase hex, 32..128 chars
    position: int         # tokens covered, positive multiple of 16 (block boundary)
    size_bytes: int
    ttl_s: float | None = None  # None: the directory's default entry TTL


class EngineLoad(NamedTuple):
    running_seqs: int = 0
    waiting_seqs: int = 0
    free_slots: int = 0
    free_blocks: int = 0


class Holder(NamedTuple):
    """A live engine holding a snapshot, as returned by lookup."""

    engine_id: str
    address: str
    position: int
    size_bytes: int
    ttl_ms: int  # time left on the entry


class LeaseGrant(NamedTuple):
    """What a heartbeat returns."""

    lease_ttl_ms: int
    epoch: int
    new_lease: bool


class EngineInfo(NamedTuple):
    engine_id: str
    address: str
    load: EngineLoad
    heartbeat_age_ms: int
    lease_left_ms: int
    epoch: int
    entries: int


class SweepReport(NamedTuple):
    """One sweeper pass: leases found lapsed, entries purged, orphan lease sets left."""

    lapsed: int
    purged: int
    orphans_left: int
