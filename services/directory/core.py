"""Directory core: the Redis-backed snapshot index (no gRPC here).

`Directory` owns the redis.asyncio client and is the only writer of the keys
described in `kvmesh.services.directory.scripts` (data model). Every public method is
one Lua script call, i.e. one round trip to Redis, whatever the batch size.

Failure behaviour: any connection problem or timeout talking to Redis becomes
`errors.Unavailable` within `op_timeout_s` (short socket timeouts, one retry on
a fresh connection). redis-py drops broken connections and dials again on the
next call, so a restarted Redis is picked up without restarting the directory.
Malformed input raises `errors.InvalidArgument` before Redis is touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvmesh import errors
from kvmesh.directory_records import (
    EngineInfo,
    EngineLoad,
    Entry,
    Holder,
    LeaseGrant,
    SweepReport,
)
from kvmesh.services.directory import scripts, validate
from kvmesh.services.directory.config import DirectoryConfig

log = logging.getLogger("kvmesh.directory")

CLIENT_NAME = "kvmesh-directory"  # shows in CLIENT LIST; tests count commands by it
SWEEP_BUDGET = 2048  # entries purged per sweep script call (bounds Redis blocking)


def connect(config: DirectoryConfig) -> aioredis.Redis:
    """A redis.asyncio client tuned to fail fast and reconnect by itself."""
    return aioredis.Redis.from_url(
        config.redis_url,
        decode_responses=True,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.connect_timeout_s,
        # One immediate retry on a fresh connection: after a Redis restart every
        # pooled connection is dead, and the retry is what makes the first call
        # after the restart succeed. More retries would only delay UNAVAILABLE.
        retry=Retry(NoBackoff(), 1),
        health_check_interval=0,
        client_name=CLIENT_NAME,
        # None keeps what the URL says (redis://user:pass@...); set values win.
        username=config.redis_username or None,
        password=config.redis_password or None,
    )


class Directory:
    """The snapshot directory. Owns `self.redis` and every key under `config.key_prefix`."""

    def __init__(self, config: DirectoryConfig, client: aioredis.Redis | None = None):
        self.config = config
        self.redis = client or connect(config)
        self._p = config.key_prefix
        self._heartbeat = self.redis.register_script(scripts.HEARTBEAT)
        self._publish = self.redis.register_script(scripts.PUBLISH)
        self._withdraw = self.redis.register_script(scripts.WITHDRAW)
        self._lookup = self.redis.register_script(scripts.LOOKUP)
        self._list = self.redis.register_script(scripts.LIST_ENGINES)
        self._sweep = self.redis.register_script(scripts.SWEEP)

    @property
    def _scripts(self):
        return (self._heartbeat, self._publish, self._withdraw, self._lookup, self._list,
                self._sweep)

    async def load_scripts(self) -> bool:
        """Load every script in one pipeline so the first calls need no NOSCRIPT retry.

        Best effort (False when Redis is down): each call also reloads its script
        on NOSCRIPT, e.g. after Redis restarted empty.
        """
        try:
            async with asyncio.timeout(self.config.op_timeout_s):
                async with self.redis.pipeline(transaction=False) as pipe:
                    for s in self._scripts:
                        pipe.script_load(s.script)
                    await pipe.execute()
            return True
        except (rexc.RedisError, TimeoutError, OSError) as exc:
            log.warning("could not preload scripts: %s", exc)
            return False

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, script, args: list) -> list:
        """Run one script; Redis trouble becomes Unavailable, never a hang."""
        try:
            async with asyncio.timeout(self.config.op_timeout_s):
                return await script(args=[self._p, *args])
        except (rexc.ConnectionError, rexc.TimeoutError, TimeoutError, OSError) as exc:
            raise errors.Unavailable(
                f"redis unavailable ({self.config.redacted_url}): {type(exc).__name__}: {exc}"
            ) from exc
        except (rexc.ReadOnlyError, rexc.BusyLoadingError) as exc:
            raise errors.Unavailable(f"redis not ready: {exc}") from exc
        except rexc.ResponseError as exc:
            if str(exc).startswith(("OOM", "MISCONF", "LOADING", "MASTERDOWN")):
                raise errors.Unavailable(f"redis refused the write: {exc}") from exc
            raise  # a script bug: reported as INTERNAL by the gRPC layer

    @staticmethod
    def _not_registered(engine_id: str) -> errors.NotFound:
        return errors.NotFound(
            f"engine {engine_id} is not registered; send Heartbeat first"
        )

    async def heartbeat(self, engine_id: str, address: str, load: EngineLoad | None = None,
                        restarted: bool = False) -> LeaseGrant:
        """Create or renew the engine's lease; `restarted` drops its earlier entries."""
        validate.check_engine_id(engine_id)
        validate.check_address(address)
        load = load or EngineLoad()
        lease_ms = self.config.lease_ttl_ms
        epoch, new = await self._run(self._heartbeat, [
            engine_id, address, lease_ms, int(bool(restarted)), *(int(x) for x in load),
        ])
        return LeaseGrant(lease_ttl_ms=lease_ms, epoch=int(epoch), new_lease=bool(new))

    async def publish(self, engine_id: str, entries: Sequence[Entry]) -> int:
        validate.check_engine_id(engine_id)
        entries = validate.check_entries(entries, self.config.max_batch,
                                         self.config.max_entry_ttl_s)
        args: list = [engine_id]
        for e in entries:
            ttl_ms = self.config.entry_ttl_ms if e.ttl_s is None else max(1, int(e.ttl_s * 1000))
            args += [e.key, int(e.position), int(e.size_bytes), ttl_ms]
        ok, n = await self._run(self._publish, args)
        if not ok:
            raise self._not_registered(engine_id)
        return int(n)

    async def withdraw(self, engine_id: str, keys: Sequence[str]) -> int:
        validate.check_engine_id(engine_id)
        keys = validate.check_keys(keys, self.config.max_batch)
        ok, n = await self._run(self._withdraw, [engine_id, *keys])
        if not ok:
            raise self._not_registered(engine_id)
        return int(n)

    async def lookup(self, keys: Sequence[str]) -> list[list[Holder]]:
        """Holders per key, in request order; only engines with a live lease."""
        keys = validate.check_keys(keys, self.config.max_batch)
        if not keys:
            return []
        rows = json.loads(await self._run(self._lookup, keys))
        return [
            [
                Holder(engine_id=r[i], address=r[i + 1], position=int(r[i + 2]),
                       size_bytes=int(r[i + 3]), ttl_ms=int(r[i + 4]))
                for i in range(0, len(r), 5)
            ]
            for r in rows
        ]

    async def list_engines(self) -> list[EngineInfo]:
        rows = await self._run(self._list, [])
        engines = [
            EngineInfo(
                engine_id=r[0], address=r[1], epoch=int(r[2]),
                load=EngineLoad(*(int(x) for x in r[3:7])),
                heartbeat_age_ms=max(0, int(r[7])), lease_left_ms=max(0, int(r[8])),
                entries=int(r[9]),
            )
            for r in rows
        ]
        return sorted(engines, key=lambda e: e.engine_id)

    async def sweep_once(self, budget: int = SWEEP_BUDGET) -> SweepReport:
        """Retire lapsed leases and purge their entries; loops until caught up."""
        lapsed = purged = 0
        while True:
            a, b, left = await self._run(self._sweep, [budget])
            lapsed, purged = lapsed + int(a), purged + int(b)
            if int(b) < budget or not int(left):
                return SweepReport(lapsed, purged, int(left))
            await asyncio.sleep(0)  # let request handlers in between batches

