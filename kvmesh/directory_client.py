"""Typed async client for DirectoryService, used by engines and the gateway.

Every call has a deadline (`timeout` per call, else the client default) and
raises `kvmesh.errors` types, never grpc ones:

    INVALID_ARGUMENT -> InvalidArgument      NOT_FOUND -> NotFound
    anything else (UNAVAILABLE, DEADLINE_EXCEEDED, ...) -> Unavailable

Engines sit on the request path and must treat a failed directory as "nobody
holds it": `find_holders()` does exactly that and never raises.
The client owns its channel; `close()` it (or use `async with`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence

import grpc

from kvmesh import errors, rpc
from kvmesh.directory_records import EngineInfo, EngineLoad, Entry, Holder, LeaseGrant
from kvmesh.proto import directory_pb2 as pb
from kvmesh.proto import directory_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.directory.client")

_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
}


def _error(exc: grpc.aio.AioRpcError) -> errors.KvmeshError:
    cls = _ERRORS.get(exc.code(), errors.Unavailable)
    return cls(f"directory {exc.code().name}: {exc.details()}")


class DirectoryClient(rpc.RpcClient):
    def __init__(self, address: str, timeout_s: float = 2.0, lookup_timeout_s: float = 0.5):
        super().__init__(address, pb_grpc.DirectoryServiceStub)
        self.timeout_s = timeout_s
        # Lookups are on the prefill path: a slow directory costs less than waiting.
        self.lookup_timeout_s = lookup_timeout_s

    async def _call(self, method, request, timeout: float | None):
        try:
            return await method(request, timeout=timeout or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def heartbeat(self, engine_id: str, address: str, load: EngineLoad | None = None,
                        restarted: bool = False, timeout: float | None = None) -> LeaseGrant:
        load = load or EngineLoad()
        resp = await self._call(self.stub.Heartbeat, pb.HeartbeatRequest(
            engine_id=engine_id, address=address, load=pb.EngineLoad(**load._asdict()),
            restarted=restarted), timeout)
        return LeaseGrant(resp.lease_ttl_ms, resp.epoch, resp.new_lease)

    async def publish(self, engine_id: str, entries: Iterable[Entry],
                      timeout: float | None = None) -> int:
        msgs = [
            pb.SnapshotEntry(key=e.key, position=e.position, size_bytes=e.size_bytes,
                             ttl_s=None if e.ttl_s is None else math.ceil(e.ttl_s))
            for e in entries
        ]
        resp = await self._call(self.stub.Publish,
                                pb.PublishRequest(engine_id=engine_id, entries=msgs), timeout)
        return resp.published

    async def lookup(self, keys: Sequence[str], timeout: float | None = None
                     ) -> dict[str, list[Holder]]:
        """Holders of each requested key (a key nobody holds maps to [])."""
        resp = await self._call(self.stub.Lookup, pb.LookupRequest(keys=list(keys)),
                                timeout or self.lookup_timeout_s)
        return {
            r.key: [Holder(h.engine_id, h.address, h.position, h.size_bytes, h.ttl_ms)
                    for h in r.holders]
            for r in resp.results
        }

    async def find_holders(self, keys: Sequence[str], timeout: float | None = None
                           ) -> dict[str, list[Holder]]:
        """Like lookup, but any failure means "no holder": never raises."""
        try:
            return await self.lookup(keys, timeout)
        except errors.KvmeshError as exc:
            log.warning("directory lookup failed, treating %d keys as unheld: %s", len(keys), exc)
            return {k: [] for k in keys}

    async def withdraw(self, engine_id: str, keys: Iterable[str],
                       timeout: float | None = None) -> int:
        resp = await self._call(self.stub.Withdraw,
                                pb.WithdrawRequest(engine_id=engine_id, keys=list(keys)), timeout)
        return resp.withdrawn

    async def list_engines(self, timeout: float | None = None) -> list[EngineInfo]:
        resp = await self._call(self.stub.ListEngines, pb.ListEnginesRequest(), timeout)
        return [
            EngineInfo(e.engine_id, e.address,
                       EngineLoad(e.load.running_seqs, e.load.waiting_seqs, e.load.free_slots,
                                  e.load.free_blocks),
                       e.heartbeat_age_ms, e.lease_left_ms, e.epoch, e.entries)
            for e in resp.engines
        ]
