"""Kvstore configuration: one frozen dataclass, read from `KVMESH_KVSTORE_*`.

Values discovered at run time (which locations are up, bytes in use) live in
the objects that own them, never here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from kvmesh.services.kvstore.ec import Layout
from kvmesh.services.kvstore.health import HealthPolicy

MiB = 1024 * 1024
GiB = 1024 * MiB
DAY = 86400.0
ENV_PREFIX = "KVMESH_KVSTORE_"


@dataclass(frozen=True)
class ShardLocation:
    """Where shard i of every object lives: an S3 endpoint and a bucket."""

    endpoint: str
    bucket: str

    @classmethod
    def parse(cls, text: str) -> ShardLocation:
        """`http://host:port/bucket` -> ShardLocation."""
        text = text.strip().rstrip("/")
        scheme, sep, rest = text.partition("://")
        host, slash, bucket = rest.partition("/")
        if not sep or not slash or not host or not bucket or "/" in bucket:
            raise ValueError(f"shard location {text!r} is not http(s)://host:port/bucket")
        return cls(f"{scheme}://{host}", bucket)

    def __str__(self) -> str:
        return f"{self.endpoint}/{self.bucket}"


@dataclass(frozen=True)
class KvstoreConfig:
    locations: tuple[ShardLocation, ...]
    data_dir: Path = Path(".kvmesh/kvstore")
    host: str = "127.0.0.1"
    port: int = 7100
    mem_bytes: int = 256 * MiB
    disk_bytes: int = 4 * GiB
    capacity_bytes: int = 100 * GiB  # durable (logical) bytes GC keeps under
    high_watermark: float = 0.90  # GC starts evicting LRU above this share of capacity
    low_watermark: float = 0.80  # ... and stops at this share
    max_object_bytes: int = 64 * MiB
    ttl_agent_s: float = 3 * DAY
    ttl_chatbot_s: float = 7 * DAY
    gc_interval_s: float = 300.0
    orphan_grace_s: float = 3600.0  # shards without a committed record older than this go
    write_quorum: int = 11  # shards that must land for a put to succeed (k..n)
    access_flush_s: float = 1.0  # access times reach sqlite at most this late
    s3_connect_timeout_s: float = 1.0
    s3_read_timeout_s: float = 5.0
    # A late shard read with nothing left to hedge to is awaited max(s3_give_up_s, 8 x its
    # budget) from its start, then given up on (the get is a miss): three hung locations
    # must not hold every get for the socket timeout. Raising it to s3_read_timeout_s waits
    # out a store that is only slow (a loaded machine) instead of missing.
    s3_give_up_s: float = 2.0
    location_retry_s: float = 2.0  # a down location gets one trial read this often
    # Hedged shard reads (health.py): a shard read is late after hedge_factor x the
    # location's recent p90 latency (at least hedge_floor_s); a late data shard is
    # replaced by a parity read. A location is down when, within health_window_s, it
    # had >= health_min_errors errors (timeouts, late reads, 5xx) and an error share
    # >= health_error_rate.
    hedge_factor: float = 2.0
    hedge_floor_s: float = 0.1
    health_window_s: float = 10.0
    health_min_errors: int = 3
    health_error_rate: float = 0.6
    threads_per_location: int = 4
    # Object/run reads from S3 in flight at once in this process, over all Gets. One Get
    # of many blocks (a prefetch of a long prefix) would otherwise start every run read
    # at once; their shard GETs queue behind threads_per_location, the queued ones pass
    # the late deadline and each turns into a hedged full decode (twice the requests).
    s3_reads_in_flight: int = 16
    # A put of several blocks is stored as runs of up to run_blocks blocks and
    # run_max_bytes payload each (runs.py); 1 = every block an object of its own.
    run_blocks: int = 16
    run_max_bytes: int = 64 * MiB
    # Compaction (compaction.py, end of each GC pass): a run older than compact_min_age_s
    # whose live blocks hold less than compact_live_fraction of its bytes is rewritten.
    compact_live_fraction: float = 0.25
    compact_min_age_s: float = 3600.0
    # The live index (--index, KVMESH_KVSTORE_INDEX): "sqlite" (a file in data_dir, one
    # process) or redis://host:port/db, shared by every kvstore replica over the same
    # locations (meta_redis.py). Redis credentials come from the environment only:
    # KVMESH_KVSTORE_REDIS_USERNAME and KVMESH_KVSTORE_REDIS_PASSWORD, never a flag.
    index: str = "sqlite"
    index_prefix: str = "kvmesh:kv"  # every index key starts with it (the mesh ACL: kvmesh:*)
    redis_username: str = field(default="", repr=False)
    redis_password: str = field(default="", repr=False)
    replica: str = ""  # this replica's name in lease logs ("" = host:pid)
    lease_ttl_s: float = 10.0  # a dead lease holder's GC/scrub lease frees after this
    layout: Layout = field(default_factory=Layout)

    def __post_init__(self) -> None:
        n = self.layout.n
        if len(self.locations) != n:
            raise ValueError(f"need exactly {n} shard locations, got {len(self.locations)}")
        if len(set(self.locations)) != n:
            raise ValueError("shard locations must be distinct")
        if not (self.layout.k <= self.write_quorum <= n):
            raise ValueError(f"write_quorum {self.write_quorum} outside [{self.layout.k}, {n}]")
        if not (0 < self.low_watermark < self.high_watermark <= 1.0):
            raise ValueError("need 0 < low_watermark < high_watermark <= 1")
        for name in ("mem_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("capacity_bytes", "max_object_bytes", "threads_per_location", "run_blocks",
                     "run_max_bytes", "s3_reads_in_flight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("ttl_agent_s", "ttl_chatbot_s", "gc_interval_s", "access_flush_s",
                     "s3_connect_timeout_s", "s3_read_timeout_s", "s3_give_up_s",
                     "hedge_factor", "hedge_floor_s", "health_window_s", "health_min_errors"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.orphan_grace_s < 0 or self.location_retry_s < 0:
            raise ValueError("orphan_grace_s and location_retry_s must be >= 0")
        if not (0 < self.health_error_rate <= 1.0):
            raise ValueError(f"health_error_rate {self.health_error_rate} outside (0, 1]")
        if self.index != "sqlite" and not self.index.startswith(("redis://", "rediss://",
                                                                  "unix://")):
            raise ValueError(f"index must be sqlite or redis://host:port/db, got {self.index!r}")
        if not self.index_prefix.startswith("kvmesh:") or any(c.isspace()
                                                              for c in self.index_prefix):
            raise ValueError(f"index_prefix must start with kvmesh: (no spaces), got "
                             f"{self.index_prefix!r}")
        if not 0 <= self.compact_live_fraction < 1 or self.compact_min_age_s < 0:
            raise ValueError("need 0 <= compact_live_fraction < 1 and compact_min_age_s >= 0")
        if not self.lease_ttl_s >= 0.5:
            raise ValueError(f"lease_ttl_s must be >= 0.5, got {self.lease_ttl_s}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port {self.port} out of range")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def ttl_s(self, traffic_class: str) -> float:
        """TTL of a class name (kvmesh.generation.TRAFFIC_CLASSES); anything else: chatbot's."""
        return self.ttl_agent_s if traffic_class == "agent" else self.ttl_chatbot_s

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> KvstoreConfig:
        """Defaults <- `KVMESH_KVSTORE_<FIELD>` <- explicit overrides (None = not given).

        LOCATIONS is a comma-separated list of `http://host:port/bucket`.
        """
        env = os.environ if env is None else env
        values: dict = {}
        for f in fields(cls):
            if f.name == "layout":
                continue
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _convert(f.name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(values.get("locations"), str):
            values["locations"] = _convert("locations", values["locations"])
        if "locations" not in values:
            raise ValueError(f"no shard locations: set {ENV_PREFIX}LOCATIONS or --locations")
        values["locations"] = tuple(
            loc if isinstance(loc, ShardLocation) else ShardLocation.parse(loc)
            for loc in values["locations"]
        )
        if "data_dir" in values:
            values["data_dir"] = Path(values["data_dir"])
        return cls(**values)

    def health_policy(self) -> HealthPolicy:
        return HealthPolicy(
            window_s=self.health_window_s, min_errors=self.health_min_errors,
            error_rate=self.health_error_rate, retry_s=self.location_retry_s,
            factor=self.hedge_factor, floor_s=self.hedge_floor_s,
            ceiling_s=self.s3_read_timeout_s)

    def with_(self, **changes) -> KvstoreConfig:
        return replace(self, **changes)


_INTS = {"port", "mem_bytes", "disk_bytes", "capacity_bytes", "max_object_bytes",
         "write_quorum", "threads_per_location", "health_min_errors", "run_blocks",
         "run_max_bytes", "s3_reads_in_flight"}
_STRS = {"host", "index", "index_prefix", "redis_username", "redis_password", "replica"}


def _convert(name: str, raw: str):
    if name == "locations":
        return tuple(ShardLocation.parse(p) for p in raw.split(",") if p.strip())
    if name == "data_dir":
        return Path(raw)
    if name in _STRS:
        return raw
    try:
        return int(raw) if name in _INTS else float(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
