"""Run the kvstore: core + gRPC server (health, reflection) on one event loop.

`KvstoreServer` owns the `KvStore` and the `kvmesh.rpc.Server` it serves.
`ServerThread` runs one on a private event loop in a background thread, for
tests and benchmarks that want a real socket server in-process (with an
injected clock) while calling it from their own loops.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from kvmesh.proto import kvstore_pb2_grpc as pb_grpc
from kvmesh.rpc import Server
from kvmesh.services.kvstore.config import KvstoreConfig
from kvmesh.services.kvstore.core import KvStore
from kvmesh.services.kvstore.service import SERVICE_NAME, KvstoreServicer


class KvstoreServer:
    def __init__(self, cfg: KvstoreConfig, clock: Callable[[], float] = time.time,
                 background: bool = True):
        self.cfg = cfg
        self.clock = clock
        self.background = background
        self.core: KvStore | None = None
        self.rpc: Server | None = None

    async def start(self) -> int:
        """Start serving; returns the bound port (useful with port 0)."""
        self.core = KvStore(self.cfg, self.clock)
        self.rpc = Server(self.cfg.address, [SERVICE_NAME], metrics_service="kvstore")
        pb_grpc.add_KvstoreServiceServicer_to_server(KvstoreServicer(self.core), self.rpc.server)
        await self.rpc.start()
        if self.background:
            self.core.start_background()
        return self.rpc.port

    async def stop(self, grace: float = 2.0) -> None:
        if self.rpc is not None:
            await self.rpc.stop(grace)
        if self.core is not None:
            await self.core.close()


class ServerThread:
    """A KvstoreServer on its own loop in a daemon thread: start() / stop()."""

    def __init__(self, cfg: KvstoreConfig, clock: Callable[[], float] = time.time,
                 background: bool = False):
        self.server = KvstoreServer(cfg, clock, background)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def core(self) -> KvStore:
        return self.server.core

    def call(self, coro, timeout: float = 60.0):
        """Run a coroutine on the server's loop (e.g. core methods) and wait."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ServerThread:
        self.thread.start()
        self.port = self.call(self.server.start())
        return self

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
