"""The maintenance lease: GC, scrub --repair, reindex and compaction run on one kvstore
replica at a time.

Shared index (Redis): `SET P:lease <holder>/<token> NX PX ttl` takes it; a task renews
it every ttl/3 with a script that extends it only while the value is still our token,
and release deletes it only if so (index_scripts.LEASE_*). A replica that dies holding
it (SIGKILL) loses it after `ttl`. If a renewal finds the lease gone or taken, or Redis
stays unreachable for a whole ttl, the handle is `lost` and the pass stops at its next
`check()` (before each deletion), so two runners never delete at once for longer
than one step. Every pass is logged (holder, what, start, end) in the list
P:lease:log (last 200), which `admin gc stats` users and the tests read.

sqlite index (one process): `LocalLease`, never contended; the core's own lock
serialises passes inside the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator

from kvmesh.errors import Unavailable
from kvmesh.services.kvstore import index_scripts as S

log = logging.getLogger("kvmesh.kvstore.lease")
LOG_LENGTH = 200


class Held:
    """A lease being held: `check()` raises once it has been lost."""

    def __init__(self, what: str):
        self.what = what
        self.lost = False

    def check(self) -> None:
        if self.lost:
            raise Unavailable(f"{self.what} stopped: the maintenance lease was lost")


class LocalLease:
    holder = "local"

    @contextlib.asynccontextmanager
    async def hold(self, what: str) -> AsyncIterator[Held]:
        yield Held(what)

    def history(self) -> list[dict]:
        return []


class SharedLease:
    def __init__(self, meta, holder: str, ttl_s: float):
        self._meta = meta  # RedisMeta: its client and its `_do` error mapping
        self.key = f"{meta.prefix}:lease"
        self.log_key = f"{meta.prefix}:lease:log"
        self.holder = holder
        self.ttl_ms = max(200, int(ttl_s * 1000))
        self._renew_s = self._meta.redis.register_script(S.LEASE_RENEW)
        self._release_s = self._meta.redis.register_script(S.LEASE_RELEASE)

    @contextlib.asynccontextmanager
    async def hold(self, what: str) -> AsyncIterator[Held]:
        token = f"{self.holder}/{secrets.token_hex(8)}"
        got = self._meta._do(lambda r: r.set(self.key, token, nx=True, px=self.ttl_ms))
        if not got:
            other = self._meta._do(lambda r: r.get(self.key)) or "?"
            raise Unavailable(f"{what}: the maintenance lease is held by "
                              f"{other.rsplit('/', 1)[0]} (one runner at a time)")
        held = Held(what)
        renewer = asyncio.create_task(self._renew(token, held))
        start = time.time()
        try:
            yield held
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            entry = json.dumps({"holder": self.holder, "what": what, "start": start,
                                "end": time.time(), "lost": held.lost})
            try:
                self._meta._do(lambda r: (
                    self._release_s(keys=[self.key], args=[token], client=r),
                    r.pipeline().rpush(self.log_key, entry)
                    .ltrim(self.log_key, -LOG_LENGTH, -1).execute()))
            except Unavailable:
                log.warning("lease for %s not released (redis down): expires in %d ms",
                            what, self.ttl_ms)

    async def _renew(self, token: str, held: Held) -> None:
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                ok = self._meta._do(lambda r: self._renew_s(
                    keys=[self.key], args=[token, self.ttl_ms], client=r))
            except Unavailable:
                ok = time.monotonic() - last_ok < self.ttl_ms / 1000
            else:
                last_ok = time.monotonic()
            if not ok:
                log.warning("maintenance lease for %s lost", held.what)
                held.lost = True
                return

    def history(self) -> list[dict]:
        """Passes run under the lease by any replica, oldest first."""
        return [json.loads(x) for x in self._meta._do(lambda r: r.lrange(self.log_key, 0, -1))]
