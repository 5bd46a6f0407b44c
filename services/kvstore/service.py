"""gRPC servicer for KvstoreService: converts messages, calls `KvStore`.

Owns nothing but the reference to the core. Streaming shapes:
  Put  (client stream): header, chunk*, header, chunk*, ...
  Get  (server stream): per key in request order: header, chunk*
  RunGC / Scrub (server stream): progress*, report
"""

from __future__ import annotations

import asyncio

from kvmesh.errors import InvalidArgument
from kvmesh.generation import traffic_class_name, traffic_class_to_proto
from kvmesh.proto import kvstore_pb2 as pb
from kvmesh.proto import kvstore_pb2_grpc as pb_grpc
from kvmesh.rpc import map_errors
from kvmesh.services.kvstore.core import KvStore
from kvmesh.services.kvstore.reports import GcReport, ReindexReport, ScrubReport, Stats

CHUNK_BYTES = 1024 * 1024
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvstoreService"].full_name


def chunks(data: bytes, size: int = CHUNK_BYTES):
    view = memoryview(data)
    for off in range(0, len(data), size):
        yield bytes(view[off:off + size])


class KvstoreServicer(pb_grpc.KvstoreServiceServicer):
    def __init__(self, core: KvStore):
        self.core = core

    @map_errors
    async def Put(self, request_iterator, context):
        items: list[tuple[str, bytearray, str, int]] = []
        # A bad message is answered once the client has sent its whole stream: an answer while
        # it still writes races its writes, and the client may then see INTERNAL ("Internal
        # error from Core") instead of INVALID_ARGUMENT (grpc/grpc#36066). The rest is read
        # and dropped.
        refused: InvalidArgument | None = None
        async for req in request_iterator:
            if refused is None:
                try:
                    self._take(req, items)
                except InvalidArgument as exc:
                    refused = exc
                    items.clear()
        if refused is not None:
            raise refused
        for key, buf, _, size in items:
            if len(buf) != size:
                raise InvalidArgument(f"object {key}: got {len(buf)} bytes, declared {size}")
        stored = await self.core.put_objects([(k, bytes(b), tc) for k, b, tc, _ in items])
        return pb.PutResponse(stored=stored)

    def _take(self, req, items: list[tuple[str, bytearray, str, int]]) -> None:
        """One message of a Put stream into `items`: a header opens an object, a chunk extends
        the open one. InvalidArgument naming the object when the stream breaks a rule."""
        part = req.WhichOneof("part")
        if part == "header":
            h = req.header
            # a number outside the enum becomes a name check_put rejects, naming it
            tc = self.core.check_put(h.key, h.size, traffic_class_name(h.traffic_class))
            items.append((h.key, bytearray(), tc, h.size))
        elif part == "chunk":
            if not items:
                raise InvalidArgument("Put stream must start with a header")
            key, buf, _, size = items[-1]
            if len(req.chunk) > CHUNK_BYTES or len(buf) + len(req.chunk) > size:
                raise InvalidArgument(f"object {key}: chunks exceed the declared {size} bytes")
            buf += req.chunk

    @map_errors
    async def Get(self, request, context):
        found = await self.core.get(list(request.keys))
        for i, data in enumerate(found):
            yield pb.GetResponse(header=pb.GetHeader(
                index=i, found=data is not None, size=len(data) if data is not None else 0))
            if data:
                for chunk in chunks(data):
                    yield pb.GetResponse(chunk=chunk)

    @map_errors
    async def Lookup(self, request, context):
        return pb.LookupResponse(prefix_length=await self.core.lookup(list(request.keys)))

    @map_errors
    async def Delete(self, request, context):
        return pb.DeleteResponse(deleted=await self.core.delete(list(request.keys)))

    @map_errors
    async def Stats(self, request, context):
        return stats_pb(await self.core.stats())

    @map_errors
    async def List(self, request, context):
        entries, nxt = await self.core.list(request.page_token, request.page_size or 1000)
        return pb.ListResponse(next_page_token=nxt, objects=[
            pb.ObjectInfo(key=e.key, size=e.size,
                          traffic_class=traffic_class_to_proto(e.traffic_class),
                          created_unix=e.created, last_access_unix=e.last_access,
                          complete=e.complete) for e in entries])

    @map_errors
    async def RunGC(self, request, context):
        async for kind, value in _with_progress(
            lambda progress: self.core.run_gc(request.dry_run, progress)
        ):
            yield (pb.RunGCResponse(progress=value) if kind == "progress"
                   else pb.RunGCResponse(report=gc_pb(value)))

    @map_errors
    async def Scrub(self, request, context):
        async for kind, value in _with_progress(
            lambda progress: self.core.scrub(request.repair, progress)
        ):
            yield (pb.ScrubResponse(progress=value) if kind == "progress"
                   else pb.ScrubResponse(report=scrub_pb(value)))

    @map_errors
    async def Reindex(self, request, context):
        async for kind, value in _with_progress(self.core.reindex):
            yield (pb.ReindexResponse(progress=value) if kind == "progress"
                   else pb.ReindexResponse(report=reindex_pb(value)))


async def _with_progress(start):
    """Run `start(progress_callback)` and yield ("progress", msg)* then ("report", result)."""
    queue: asyncio.Queue = asyncio.Queue()

    def progress(phase: str, done: int, total: int) -> None:
        queue.put_nowait(pb.Progress(phase=phase, done=done, total=total))

    task = asyncio.ensure_future(start(progress))
    try:
        while not task.done() or not queue.empty():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield "progress", getter.result()
            else:
                getter.cancel()
        yield "report", task.result()
    finally:
        if not task.done():
            task.cancel()


def stats_pb(s: Stats) -> pb.StatsResponse:
    return pb.StatsResponse(
        objects=s.objects, bytes=s.bytes, pending=s.pending,
        classes=[pb.ClassUsage(traffic_class=traffic_class_to_proto(c), objects=n, bytes=s.bytes_by_class.get(c, 0))
                 for c, n in sorted(s.objects_by_class.items())],
        mem_objects=s.mem_objects, mem_bytes=s.mem_bytes, mem_capacity=s.mem_capacity,
        disk_objects=s.disk_objects, disk_bytes=s.disk_bytes, disk_capacity=s.disk_capacity,
        capacity_bytes=s.capacity_bytes, high_watermark=s.high_watermark,
        low_watermark=s.low_watermark,
        locations=[pb.LocationStatus(index=i, location=loc, up=up)
                   for i, (loc, up) in enumerate(zip(s.locations, s.locations_up, strict=True))],
        counters=s.counters,
    )


def gc_pb(r: GcReport) -> pb.GcReport:
    return pb.GcReport(dry_run=r.dry_run, expired=r.expired, evicted=r.evicted, stale=r.stale,
                       orphans=r.orphans, skipped_busy=r.skipped_busy,
                       bytes_freed=r.bytes_freed, bytes_before=r.bytes_before)


def scrub_pb(r: ScrubReport) -> pb.ScrubReport:
    return pb.ScrubReport(repair=r.repair, objects=r.objects, healthy=r.healthy,
                          degraded=r.degraded, lost=r.lost, shards_bad=r.shards_bad,
                          shards_repaired=r.shards_repaired)


def reindex_pb(r: ReindexReport) -> pb.ReindexReport:
    return pb.ReindexReport(objects=r.objects, runs=r.runs, blocks_found=r.blocks_found,
                            restored=r.restored, unreadable=r.unreadable)
