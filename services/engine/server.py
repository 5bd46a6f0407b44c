"""Run one engine as a gRPC server until SIGINT/SIGTERM, then shut down gracefully."""

from __future__ import annotations

import asyncio
import logging
import signal

from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import Server
from services.engine.async_engine import AsyncEngine
from services.engine.engine import EngineCore
from services.engine.service import EngineServicer

log = logging.getLogger("kvmesh.engine")
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


async def serve(core: EngineCore, address: str) -> None:
    engine = AsyncEngine(core)
    server = Server(address, [SERVICE_NAME])
    engine_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(engine), server.server)
    await server.start()
    log.info("engine serving on port %d (preset %s)", server.port, core.cfg.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("engine shutting down")
    await server.stop(grace=5.0)
    engine.shutdown()
