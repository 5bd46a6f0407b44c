"""Fixtures: a real Valkey process and a directory served over real gRPC.

The directory (grpc.aio server + sweeper) and the async client live on one event
loop in a background thread; tests stay synchronous and hand coroutines to it
with `h.run(...)`. Each harness uses its own key prefix, so tests sharing the
session Valkey never see each other's keys.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

from kvmesh.directory_client import DirectoryClient
from kvmesh.launch.backing.valkey import ValkeyProcess
from kvmesh.services.directory.config import DirectoryConfig
from kvmesh.services.directory.service import DirectoryServer


def key(i: int) -> str:
    """A well-formed 64-hex snapshot key."""
    return f"{i:064x}"


class Harness:
    """One DirectoryServer + DirectoryClient on a private loop thread."""

    def __init__(self, config: DirectoryConfig):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: DirectoryServer = self.run(self._start())
        self.address = f"127.0.0.1:{self.server.port}"
        self.client: DirectoryClient = self.run(self._client())

    async def _start(self) -> DirectoryServer:
        return await DirectoryServer(self.config, "127.0.0.1:0").start()

    async def _client(self) -> DirectoryClient:
        return DirectoryClient(self.address)

    @property
    def directory(self):
        return self.server.directory

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.client.close())
            self.run(self.server.stop(grace=0.2))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="session")
def valkey():
    with ValkeyProcess() as server:
        yield server


@pytest.fixture
def make_directory(valkey):
    """Factory: make_directory(redis=None, **config overrides) -> Harness (closed after)."""
    made: list[Harness] = []

    def make(redis: ValkeyProcess | None = None, **overrides) -> Harness:
        settings = dict(redis_url=(redis or valkey).url, key_prefix=f"t:{uuid.uuid4().hex[:10]}")
        settings.update(overrides)
        h = Harness(DirectoryConfig(**settings))
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def directory(make_directory) -> Harness:
    return make_directory()
