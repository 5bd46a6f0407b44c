"""uvicorn inside the gateway's running event loop (no second process, no thread).

`uvicorn.Server.serve()` would install its own SIGINT/SIGTERM handlers and re-raise
them; the gateway already owns shutdown (`kvmesh.rpc.shutdown_signal`), so only
uvicorn's `startup()` and `shutdown()` are used. The server owns its listening socket
and connections; `stop()` closes them, letting in-flight responses finish for up to
`grace` seconds.
"""

from __future__ import annotations

import logging

import uvicorn

from kvmesh.services.gateway.core import GatewayCore
from kvmesh.services.gateway.openai_api.app import OpenAIApp
from kvmesh.tls import TlsFiles

log = logging.getLogger("kvmesh.gateway.http")


class HttpServer:
    def __init__(self, core: GatewayCore, host: str, port: int, grace: float = 5.0,
                 tls: TlsFiles | None = None):
        # HTTPS with the process's certificate (kvmesh/tls.py); callers authenticate
        # with API keys, so no client certificate is asked for.
        tls = tls or TlsFiles()
        self.config = uvicorn.Config(
            OpenAIApp(core).app, host=host, port=port, loop="none", http="httptools",
            lifespan="off", access_log=False, log_config=None, server_header=False,
            date_header=False, timeout_graceful_shutdown=grace,
            ssl_certfile=tls.cert or None, ssl_keyfile=tls.key or None)
        self.server = uvicorn.Server(self.config)
        self.port = 0

    async def start(self) -> int:
        """Listen; returns the bound port (the configured one, or a free one for 0)."""
        if not self.config.loaded:
            self.config.load()
        # What Server._serve does before startup(), without its signal handling.
        self.server.lifespan = self.config.lifespan_class(self.config)
        try:
            await self.server.startup()
        except SystemExit:  # uvicorn's way to report a bind failure (logged by it)
            raise OSError(f"HTTP API: cannot listen on {self.config.host}:{self.config.port}"
                          ) from None
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server.started:
            await self.server.shutdown()
