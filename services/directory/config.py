"""Directory configuration: one frozen dataclass; `KVMESH_DIRECTORY_*` read only here.

| env var                                  | field              | default                    |
|------------------------------------------|--------------------|----------------------------|
| KVMESH_DIRECTORY_REDIS_URL               | redis_url          | redis://127.0.0.1:6379/0   |
| KVMESH_DIRECTORY_REDIS_USERNAME          | redis_username     | "" (the URL's, or none)    |
| KVMESH_DIRECTORY_REDIS_PASSWORD          | redis_password     | "" (the URL's, or none)    |
| KVMESH_DIRECTORY_KEY_PREFIX              | key_prefix         | kvmesh:dir                 |
| KVMESH_DIRECTORY_ENTRY_TTL_S             | entry_ttl_s        | 1800 (30 min)              |
| KVMESH_DIRECTORY_MAX_ENTRY_TTL_S         | max_entry_ttl_s    | 86400                      |
| KVMESH_DIRECTORY_LEASE_TTL_S             | lease_ttl_s        | 10                         |
| KVMESH_DIRECTORY_MAX_BATCH               | max_batch          | 4096                       |
| KVMESH_DIRECTORY_SWEEP_INTERVAL_S        | sweep_interval_s   | 2                          |
| KVMESH_DIRECTORY_REDIS_TIMEOUT_S         | redis_timeout_s    | 1.0 (socket read/write)    |
| KVMESH_DIRECTORY_CONNECT_TIMEOUT_S       | connect_timeout_s  | 0.5 (TCP connect)          |
| KVMESH_DIRECTORY_OP_TIMEOUT_S            | op_timeout_s       | 3.0 (whole call, retries)  |

Redis credentials: `redis_username`/`redis_password` (or `redis://user:pass@host/0`), from
the environment only, never a flag, so they stay out of `ps` and of the logs; logs show
`redacted_url`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from kvmesh.envs import config_from_env

ENV_PREFIX = "KVMESH_DIRECTORY_"


@dataclasses.dataclass(frozen=True)
class DirectoryConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_username: str = dataclasses.field(default="", repr=False)
    redis_password: str = dataclasses.field(default="", repr=False)
    # Every Redis key the directory writes starts with this, so several meshes
    # (or tests) can share one Redis.
    key_prefix: str = "kvmesh:dir"
    entry_ttl_s: float = 1800.0
    max_entry_ttl_s: float = 86400.0
    lease_ttl_s: float = 10.0
    max_batch: int = 4096
    sweep_interval_s: float = 2.0
    # Short socket timeouts: a dead Redis must turn into UNAVAILABLE in about a
    # second, never a hung call (engines sit on the request path).
    redis_timeout_s: float = 1.0
    connect_timeout_s: float = 0.5
    op_timeout_s: float = 3.0

    def __post_init__(self):
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must be redis://, rediss:// or unix://, got {self.redis_url!r}")
        if not self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise ValueError(f"key_prefix must be non-empty without spaces, got {self.key_prefix!r}")
        for name in ("entry_ttl_s", "lease_ttl_s", "sweep_interval_s", "redis_timeout_s",
                     "connect_timeout_s", "op_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.entry_ttl_s > self.max_entry_ttl_s:
            raise ValueError("entry_ttl_s must be <= max_entry_ttl_s")
        if self.lease_ttl_s < 0.2:
            raise ValueError("lease_ttl_s must be >= 0.2 s (heartbeats need headroom)")
        if not 1 <= self.max_batch <= 100_000:
            raise ValueError(f"max_batch must be in [1, 100000], got {self.max_batch}")

    @property
    def redacted_url(self) -> str:
        """The URL with any password replaced by `***`: the only form that is logged."""
        return re.sub(r"^(\w+://)([^@/]*)@", lambda m: m.group(1) + (
            m.group(2).split(":")[0] + ":***" if ":" in m.group(2) else m.group(2)) + "@",
            self.redis_url)

    @property
    def entry_ttl_ms(self) -> int:
        return int(self.entry_ttl_s * 1000)

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> DirectoryConfig:
        """Defaults, then `KVMESH_DIRECTORY_<FIELD>` variables, then explicit overrides."""
        return config_from_env(cls, ENV_PREFIX, env, **overrides)
