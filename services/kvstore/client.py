"""Typed async client for KvstoreService (engines, admin CLI, tests).

    client = KvstoreClient("127.0.0.1:7100", timeout=2.0)
    n = await client.lookup(block_hashes)         # longest stored prefix
    blobs = await client.get(block_hashes[:n])    # bytes or None per key
    await client.put([(h, blob)], traffic_class="agent")

Errors arrive as grpc.aio.AioRpcError (INVALID_ARGUMENT, UNAVAILABLE, ...).
Several replicas (`--kvstore a,b`): `connect("a,b")` gives a `KvstorePool`, same calls.
A missing object is never an error: `get` returns None in its place.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import AsyncIterator

import grpc

from kvmesh.generation import traffic_class_to_proto
from kvmesh.proto import kvstore_pb2 as pb
from kvmesh.proto import kvstore_pb2_grpc as pb_grpc
from kvmesh.rpc import RpcClient

CHUNK_BYTES = 1024 * 1024


class KvstoreClient(RpcClient):
    def __init__(self, address: str, timeout: float | None = None):
        """`timeout` (seconds) applies to every call unless the call passes its own."""
        super().__init__(address, pb_grpc.KvstoreServiceStub)
        self.timeout = timeout

    def _t(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    async def put(self, items: list[tuple[str, bytes]], traffic_class: str | int = "chatbot",
                  timeout: float | None = None) -> int:
        """`traffic_class`: a name ("agent", "chatbot") or a common.v1 TrafficClass number
        as is (the server rejects numbers outside the enum)."""
        if isinstance(traffic_class, str):
            traffic_class = traffic_class_to_proto(traffic_class)

        async def stream():
            for key, data in items:
                yield pb.PutRequest(header=pb.ObjectHeader(
                    key=key, size=len(data), traffic_class=traffic_class))
                view = memoryview(data)
                for off in range(0, len(data), CHUNK_BYTES):
                    yield pb.PutRequest(chunk=bytes(view[off:off + CHUNK_BYTES]))

        resp = await self.stub.Put(stream(), timeout=self._t(timeout))
        return resp.stored

    async def get(self, keys: list[str], timeout: float | None = None) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        parts: list[bytes] = []
        current = -1
        async for msg in self.stub.Get(pb.GetRequest(keys=keys), timeout=self._t(timeout)):
            if msg.WhichOneof("part") == "header":
                if current >= 0:
                    out[current] = b"".join(parts)
                current, parts = (msg.header.index if msg.header.found else -1), []
            else:
                parts.append(msg.chunk)
        if current >= 0:
            out[current] = b"".join(parts)
        return out

    async def lookup(self, keys: list[str], timeout: float | None = None) -> int:
        resp = await self.stub.Lookup(pb.LookupRequest(keys=keys), timeout=self._t(timeout))
        return resp.prefix_length

    async def delete(self, keys: list[str], timeout: float | None = None) -> int:
        resp = await self.stub.Delete(pb.DeleteRequest(keys=keys), timeout=self._t(timeout))
        return resp.deleted

    async def stats(self, timeout: float | None = None) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest(), timeout=self._t(timeout))

    async def list_page(self, page_token: str = "", page_size: int = 1000,
                        timeout: float | None = None) -> pb.ListResponse:
        return await self.stub.List(pb.ListRequest(page_token=page_token, page_size=page_size),
                                     timeout=self._t(timeout))

    async def list_all(self, page_size: int = 1000) -> AsyncIterator[pb.ObjectInfo]:
        token = ""
        while True:
            page = await self.list_page(token, page_size)
            for obj in page.objects:
                yield obj
            token = page.next_page_token
            if not token:
                return

    def run_gc_stream(self, dry_run: bool = False, timeout: float | None = None):
        """Async iterator of RunGCResponse: progress messages, then the report."""
        return self.stub.RunGC(pb.RunGCRequest(dry_run=dry_run), timeout=self._t(timeout))

    async def run_gc(self, dry_run: bool = False, timeout: float | None = None) -> pb.GcReport:
        async for msg in self.run_gc_stream(dry_run, timeout):
            if msg.WhichOneof("part") == "report":
                return msg.report
        raise RuntimeError("RunGC stream ended without a report")

    def scrub_stream(self, repair: bool = False, timeout: float | None = None):
        return self.stub.Scrub(pb.ScrubRequest(repair=repair), timeout=self._t(timeout))

    async def scrub(self, repair: bool = False, timeout: float | None = None) -> pb.ScrubReport:
        async for msg in self.scrub_stream(repair, timeout):
            if msg.WhichOneof("part") == "report":
                return msg.report
        raise RuntimeError("Scrub stream ended without a report")

    def reindex_stream(self, timeout: float | None = None):
        return self.stub.Reindex(pb.ReindexRequest(), timeout=self._t(timeout))

    async def reindex(self, timeout: float | None = None) -> pb.ReindexReport:
        async for msg in self.reindex_stream(timeout):
            if msg.WhichOneof("part") == "report":
                return msg.report
        raise RuntimeError("Reindex stream ended without a report")


def connect(addresses: str, timeout: float | None = None) -> KvstoreClient | KvstorePool:
    """`host:port` -> a client; `a,b,...` (kvstore replicas sharing one index) -> a pool."""
    parts = [a.strip() for a in addresses.split(",") if a.strip()]
    if not parts:
        raise ValueError("no kvstore address")
    return KvstoreClient(parts[0], timeout) if len(parts) == 1 else KvstorePool(parts, timeout)


class KvstorePool:
    """Kvstore replicas over the same shard locations and shared index, spread client-side.

    A data call goes to the replica its first key hashes to (crc32), so an engine's
    lookup and the get of the same prefix meet the same replica's hot tiers. A replica
    answering UNAVAILABLE (down, restarting, its index unreachable) is passed over for
    the next one, and put last for `cooldown_s`. Any other error is the answer: a put is
    not retried after a deadline, when it may have landed (it would land again: harmless,
    but it doubles load on a struggling store). Admin calls go to the first replica that
    answers; the lease makes any replica's GC a mesh-wide one."""

    def __init__(self, addresses: list[str], timeout: float | None = None,
                 cooldown_s: float = 2.0):
        self.addresses = list(addresses)
        self.clients = [KvstoreClient(a, timeout) for a in self.addresses]
        self.cooldown_s = cooldown_s
        self._down_until = [0.0] * len(self.clients)
        self.calls = [0] * len(self.clients)  # answered calls per replica (tests, bench)

    def _order(self, key: str) -> list[int]:
        n = len(self.clients)
        start = zlib.crc32(key.encode()) % n
        ring = [(start + i) % n for i in range(n)]
        now = time.monotonic()
        return sorted(ring, key=lambda i: self._down_until[i] > now)  # stable: up first

    async def _call(self, key: str, fn):
        last: grpc.aio.AioRpcError | None = None
        for i in self._order(key):
            try:
                out = await fn(self.clients[i])
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._down_until[i] = time.monotonic() + self.cooldown_s
                last = exc
                continue
            self.calls[i] += 1
            return out
        assert last is not None
        raise last

    async def put(self, items: list[tuple[str, bytes]], traffic_class: str | int = "chatbot",
                  timeout: float | None = None) -> int:
        return await self._call(items[0][0] if items else "",
                                lambda c: c.put(items, traffic_class, timeout))

    async def get(self, keys: list[str], timeout: float | None = None) -> list[bytes | None]:
        return await self._call(keys[0] if keys else "", lambda c: c.get(keys, timeout))

    async def lookup(self, keys: list[str], timeout: float | None = None) -> int:
        return await self._call(keys[0] if keys else "", lambda c: c.lookup(keys, timeout))

    async def delete(self, keys: list[str], timeout: float | None = None) -> int:
        return await self._call(keys[0] if keys else "", lambda c: c.delete(keys, timeout))

    async def stats(self, timeout: float | None = None) -> pb.StatsResponse:
        return await self._call("", lambda c: c.stats(timeout))

    async def close(self) -> None:
        for c in self.clients:
            await c.close()

    async def __aenter__(self) -> KvstorePool:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
