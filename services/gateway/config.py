"""Gateway configuration: one frozen dataclass; `KVMESH_GATEWAY_*` is read only here.

| env var                              | field                 | default            |
|--------------------------------------|-----------------------|--------------------|
| KVMESH_GATEWAY_HOST                  | host                  | 127.0.0.1          |
| KVMESH_GATEWAY_PORT                  | port                  | 7000               |
| KVMESH_GATEWAY_ENGINES               | engines               | "" (host:port,...) |
| KVMESH_GATEWAY_DIRECTORY             | directory             | "" (host:port)     |
| KVMESH_GATEWAY_METRICS_PORT          | metrics_port          | -1 = off           |
| KVMESH_GATEWAY_HTTP_PORT             | http_port             | -1 = off           |
| KVMESH_GATEWAY_TOKENIZER             | tokenizer             | "" = byte-level    |
| KVMESH_GATEWAY_MAX_REQUEST_BYTES     | max_request_bytes     | 4 MiB              |
| KVMESH_GATEWAY_MAX_PROMPT_BYTES      | max_prompt_bytes      | 1 MiB              |
| KVMESH_GATEWAY_MAX_PROMPT_TOKENS     | max_prompt_tokens     | 65536              |
| KVMESH_GATEWAY_MAX_TOKENS_LIMIT      | max_tokens_limit      | 8192               |
| KVMESH_GATEWAY_MAX_ATTEMPTS          | max_attempts          | 3                  |
| KVMESH_GATEWAY_MIGRATION_LIMIT       | migration_limit       | 1                  |
| KVMESH_GATEWAY_AFFINITY_ENTRIES      | affinity_entries      | 65536              |
| KVMESH_GATEWAY_MAX_IMBALANCE         | max_imbalance         | 4                  |
| KVMESH_GATEWAY_REFRESH_S             | refresh_s             | 1.0                |
| KVMESH_GATEWAY_DIRECTORY_TIMEOUT_S   | directory_timeout_s   | 0.2                |
| KVMESH_GATEWAY_DOWN_S                | down_s                | 2.0                |
| KVMESH_GATEWAY_EVENT_LOOP            | event_loop            | uvloop             |
| KVMESH_GATEWAY_ENGINE_SESSIONS       | engine_sessions       | true               |
| KVMESH_GATEWAY_API_KEYS              | api_keys              | "" = auth off      |
| KVMESH_GATEWAY_ALLOW_UNAUTHENTICATED | allow_unauthenticated | false              |
| KVMESH_GATEWAY_PREFILL_ENGINES       | prefill_engines       | "" (host:port,...) |
| KVMESH_GATEWAY_DECODE_ENGINES        | decode_engines        | "" (host:port,...) |
| KVMESH_GATEWAY_STRICT_FIELDS         | strict_fields         | false              |

`prefill_engines` and `decode_engines` (both or neither): prefill/decode disaggregation
(services/gateway/pd.py). Each request is prefilled on a prefill engine, then decoded on a
decode engine; `engines` (and the directory's) are the fallback when that fails.

`api_keys`: a file of `key tenant role` lines (role `user` or `admin`); when set, every
Generate call and HTTP API request must carry `authorization: Bearer <key>` (see
kvmesh/auth.py and README.md, "Authentication and tenants"). Without keys the gateway
refuses to listen beyond loopback unless `allow_unauthenticated` is set
(`kvmesh.auth.check_public_bind`, checked when serving starts).

`event_loop`: `uvloop` (default; a declared dependency), `asyncio`, or `auto` (uvloop when
importable). grpc.aio runs on uvloop unchanged; on the 2-core box it takes ~0.15 ms of
gateway CPU and ~0.1-0.2 ms of added latency off each request (see README.md, "Latency").

`engine_sessions`: true sends every generation over one long-lived Session stream per
engine; false makes one Generate call per request (the plain path, 0.3-0.4 ms more added
latency per request on the 2-core box; see services/gateway/README.md).

`KVMESH_GATEWAY_ADDR` (read by `kvmesh generate`) is the client-side address.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from kvmesh.envs import config_from_env

ENV_PREFIX = "KVMESH_GATEWAY_"
EVENT_LOOPS = ("auto", "asyncio", "uvloop")
DEFAULT_ADDR = "127.0.0.1:7000"


def client_address(env: Mapping[str, str] | None = None) -> str:
    """Where `kvmesh generate` finds the gateway: $KVMESH_GATEWAY_ADDR or 127.0.0.1:7000."""
    env = os.environ if env is None else env
    return env.get("KVMESH_GATEWAY_ADDR") or DEFAULT_ADDR


def split_addresses(text: str) -> tuple[str, ...]:
    out = tuple(a.strip() for a in text.split(",") if a.strip())
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"engine address {a!r} is not host:port")
    return out


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 7000
    engines: str = ""                   # static engines, comma-separated host:port
    directory: str = ""                 # directory host:port; "" = static engines only
    # every kvmesh port flag: 0 = a free port, -1 = off (never 0 = off)
    metrics_port: int = -1              # Prometheus /metrics
    http_port: int = -1                 # OpenAI-compatible HTTP API
    tokenizer: str = ""                 # tokenizer.json for routing keys; "" = byte-level
    # Limits. Oversize input is RESOURCE_EXHAUSTED, out-of-range fields INVALID_ARGUMENT.
    max_request_bytes: int = 4 << 20
    max_prompt_bytes: int = 1 << 20
    max_prompt_tokens: int = 65536
    max_tokens_limit: int = 8192
    max_stop: int = 16                  # stop strings and stop token ids, each
    max_stop_bytes: int = 256
    # Routing and retries.
    max_attempts: int = 3               # engines tried before the first token
    migration_limit: int = 1            # engine failures after the first token continued elsewhere
    affinity_entries: int = 65536       # bounded LRU of prefix key -> engine
    max_imbalance: int = 4              # leave a cache-preferred engine this much busier than the idlest
    refresh_s: float = 1.0              # ListEngines period
    directory_timeout_s: float = 0.2    # Lookup is on the request path: fail fast
    down_s: float = 2.0                 # an engine that failed is avoided this long
    event_loop: str = "uvloop"          # uvloop | asyncio | auto (see the module docstring)
    engine_sessions: bool = True        # one Session stream per engine, else a call per request
    api_keys: str = ""                  # keys file (`key tenant role` lines); "" = auth off
    allow_unauthenticated: bool = False  # serve beyond loopback without api_keys
    prefill_engines: str = ""           # disaggregation: prefill engines, host:port,...
    decode_engines: str = ""            # and decode engines (both or neither)
    strict_fields: bool = False         # HTTP API: refuse unknown request fields (else ignore them)

    def __post_init__(self):
        split_addresses(self.engines)
        if bool(split_addresses(self.prefill_engines)) != bool(split_addresses(self.decode_engines)):
            raise ValueError("prefill_engines and decode_engines go together: give both or neither")
        if self.directory:
            split_addresses(self.directory)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535] (0 = a free port), got {self.port}")
        for name in ("metrics_port", "http_port"):
            if not -1 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [-1, 65535] (0 = a free port, -1 = off), "
                                 f"got {getattr(self, name)}")
        for name in ("max_request_bytes", "max_prompt_bytes", "max_prompt_tokens",
                     "max_tokens_limit", "max_stop", "max_stop_bytes", "max_attempts",
                     "affinity_entries", "max_imbalance"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0 (0 = off), got {self.migration_limit}")
        for name in ("refresh_s", "directory_timeout_s", "down_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, "
                             f"got {self.event_loop!r}")

    @property
    def engine_list(self) -> tuple[str, ...]:
        return split_addresses(self.engines)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> GatewayConfig:
        """Defaults, then `KVMESH_GATEWAY_<FIELD>` variables, then explicit (non-None) overrides."""
        return config_from_env(cls, ENV_PREFIX, env, **overrides)
