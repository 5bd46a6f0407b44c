"""Typed async client for KvstoreService (engines, admin CLI, tests).

    client = KvstoreClient("127.0.0.1:7100", timeout=2.0)
    n = await client.lookup(block_hashes)         # longest stored prefix
    blobs = await client.get(block_hashes[:n])    # bytes or None per key
    await client.put([(h, blob)], traffic_class="agent")

Errors arrive as grpc.aio.AioRpcError (INVALID_ARGUMENT, UNAVAILABLE, ...).
A missing object is never an error: `get` returns None in its place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

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
