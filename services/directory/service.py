"""gRPC servicer for DirectoryService: converts messages and calls `Directory`.

No logic lives here beyond message conversion; errors are mapped by
`kvmesh.rpc.map_errors`. `DirectoryServer` runs the servicer plus the sweeper
task and owns both; its health status follows Redis reachability.
"""

from __future__ import annotations

import asyncio
import logging

from kvmesh import errors, rpc
from kvmesh.directory_records import EngineLoad, Entry
from kvmesh.proto import directory_pb2 as pb
from kvmesh.proto import directory_pb2_grpc as pb_grpc
from kvmesh.services.directory.config import DirectoryConfig
from kvmesh.services.directory.core import Directory

log = logging.getLogger("kvmesh.directory")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DirectoryService"].full_name


def _load(msg: pb.EngineLoad) -> EngineLoad:
    return EngineLoad(msg.running_seqs, msg.waiting_seqs, msg.free_slots, msg.free_blocks)


def _load_pb(load: EngineLoad) -> pb.EngineLoad:
    return pb.EngineLoad(**load._asdict())


class DirectoryServicer(pb_grpc.DirectoryServiceServicer):
    def __init__(self, directory: Directory):
        self.directory = directory

    @rpc.map_errors
    async def Heartbeat(self, request, context):
        grant = await self.directory.heartbeat(
            request.engine_id, request.address, _load(request.load), request.restarted
        )
        return pb.HeartbeatResponse(**grant._asdict())

    @rpc.map_errors
    async def Publish(self, request, context):
        entries = [
            Entry(e.key, e.position, e.size_bytes, e.ttl_s if e.HasField("ttl_s") else None)
            for e in request.entries
        ]
        return pb.PublishResponse(published=await self.directory.publish(request.engine_id, entries))

    @rpc.map_errors
    async def Lookup(self, request, context):
        keys = list(request.keys)
        rows = await self.directory.lookup(keys)
        return pb.LookupResponse(results=[
            pb.KeyHolders(key=k, holders=[pb.Holder(**h._asdict()) for h in holders])
            for k, holders in zip(keys, rows, strict=True)
        ])

    @rpc.map_errors
    async def Withdraw(self, request, context):
        n = await self.directory.withdraw(request.engine_id, list(request.keys))
        return pb.WithdrawResponse(withdrawn=n)

    @rpc.map_errors
    async def ListEngines(self, request, context):
        engines = await self.directory.list_engines()
        return pb.ListEnginesResponse(engines=[
            pb.EngineInfo(**{**e._asdict(), "load": _load_pb(e.load)}) for e in engines
        ])


class DirectoryServer:
    """A running directory: gRPC server + sweeper. Owns the Directory it creates."""

    def __init__(self, config: DirectoryConfig, address: str = "127.0.0.1:0"):
        self.config = config
        self.directory = Directory(config)
        self.server = rpc.Server(address, [SERVICE_NAME], metrics_service="directory")
        pb_grpc.add_DirectoryServiceServicer_to_server(
            DirectoryServicer(self.directory), self.server.server
        )
        self._sweeper: asyncio.Task | None = None
        self._stopping = False
        self._serving: bool | None = None

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> DirectoryServer:
        await self.server.start()
        await self._set_serving(await self.directory.load_scripts())
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="directory-sweeper")
        return self

    async def _set_serving(self, ok: bool) -> None:
        if ok != self._serving:
            self._serving = ok
            await self.server.set_serving(ok)
            log.log(logging.INFO if ok else logging.WARNING,
                    "directory %s (redis %s)", "SERVING" if ok else "NOT_SERVING",
                    self.config.redacted_url)

    async def _sweep_loop(self) -> None:
        """Purge lapsed engines every sweep_interval_s; reports Redis health on the way."""
        while not self._stopping:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                report = await self.directory.sweep_once()
                if report.lapsed or report.purged:
                    log.info("swept %d lapsed engines, %d entries", report.lapsed, report.purged)
                await self._set_serving(True)
            except errors.Unavailable as exc:
                log.debug("sweep skipped: %s", exc)
                await self._set_serving(False)
            except Exception:  # noqa: BLE001 - the sweeper must outlive a bad pass
                log.exception("sweep failed")

    async def stop(self, grace: float = 1.0) -> None:
        # The flag ends the loop even if a pass turns the cancel into one more Unavailable
        # (a cancel landing as its op timeout expires): a test's teardown once waited 30 s
        # here with Redis gone. The wait is bounded either way: a stop must not hang.
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            done, _ = await asyncio.wait({self._sweeper},
                                         timeout=self.config.op_timeout_s + grace)
            if not done:
                log.warning("directory sweeper still running at stop; going on without it")
        await self.server.stop(grace)
        await self.directory.close()

    async def __aenter__(self) -> DirectoryServer:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
