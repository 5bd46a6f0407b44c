"""Real SeaweedFS servers for the kvstore tests, started once per session.

Five `weed server` processes hold the 12 shard locations as [3, 3, 2, 2, 2]
buckets, so killing server 2 takes exactly two locations away and killing
server 0 takes three. Each test gets its own 12 fresh buckets (same servers)
and its own kvstore data dir, so tests never see each other's objects.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import pytest

from kvmesh.launch.backing.seaweed import start_seaweed_cluster
from kvmesh.s3 import ensure_bucket, s3_client
from kvmesh.services.kvstore.client import KvstoreClient
from kvmesh.services.kvstore.config import KvstoreConfig, ShardLocation
from kvmesh.services.kvstore.server import ServerThread

BUCKETS = [3, 3, 2, 2, 2]
TWO_LOCATION_SERVER = 2
THREE_LOCATION_SERVER = 0
_ids = itertools.count()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    c = start_seaweed_cluster(len(BUCKETS), BUCKETS, tmp_path_factory.mktemp("seaweed"))
    print(f"\nseaweed cluster of {len(BUCKETS)} servers ready in {c.startup_s:.1f}s")
    yield c
    c.stop()


class FakeClock:
    """Injectable wall clock: starts at real time, moves only when told."""

    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def killer(cluster):
    """Kill weed servers for one test; restart them (same ports, same data) after."""
    killed = []

    def kill(server: int) -> list[int]:
        cluster.servers[server].kill()
        killed.append(server)
        return cluster.locations_on(server)

    yield kill
    for server in killed:
        cluster.restart(server)
        _wait_writable(cluster, server)


def _wait_writable(cluster, server: int, timeout: float = 30.0) -> None:
    """A restarted weed answers S3 (and lists buckets) a moment before its volume
    server takes writes again; the next test's put goes to fresh buckets (new
    collections, new volumes), so probe one of those."""
    client = s3_client(cluster.servers[server].endpoint)
    bucket = f"probe-{os.getpid() % 10000}x{next(_ids)}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            ensure_bucket(client, bucket)
            client.put_object(Bucket=bucket, Key="probe/restart", Body=b"x")
            client.delete_object(Bucket=bucket, Key="probe/restart")
            return
        except Exception:  # noqa: BLE001 - not ready yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="session")
def valkey(tmp_path_factory):
    """One real Valkey for the shared-index tests (each test has its own key prefix)."""
    from kvmesh.launch.backing.valkey import ValkeyProcess

    v = ValkeyProcess(work_dir=tmp_path_factory.mktemp("valkey")).start()
    yield v
    v.close()


@pytest.fixture
def shared_index(valkey):
    """Config overrides for a kvstore on the shared index, under a prefix of this test."""
    return {"index": valkey.url, "index_prefix": f"kvmesh:kv:t{os.getpid() % 10000}x{next(_ids)}"}


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def locations(cluster):
    """12 fresh buckets on the session's servers, laid out like the cluster's."""
    tag = f"t{os.getpid() % 10000}x{next(_ids)}"
    locs = []
    for i, (server, _) in enumerate(cluster.layout):
        bucket = f"kv-{tag}-{i:02d}"
        endpoint = cluster.servers[server].endpoint
        ensure_bucket(s3_client(endpoint), bucket)
        locs.append(ShardLocation(endpoint, bucket))
    return tuple(locs)


def make_config(locations, data_dir: Path, **kw) -> KvstoreConfig:
    base = dict(
        locations=locations, data_dir=data_dir, port=0, mem_bytes=64 << 20,
        disk_bytes=64 << 20, capacity_bytes=1 << 30, location_retry_s=0.3,
        orphan_grace_s=60.0, s3_read_timeout_s=5.0,
        # Under the whole suite on 2 cores a healthy SeaweedFS can stall a read past the
        # 2 s give-up (a miss: test_replicas' pool test failed so in CI); the tests here
        # assert exact hits, so they wait out slowness up to the socket timeout.
        # test_hedging passes the default back: it is the test of giving up.
        s3_give_up_s=5.0,
        # A fresh server's first reads open their connections all at once (a scrub: 48), on a
        # loop that shares the GIL with the test; 1 s to connect is tight for that under the
        # whole suite (test_failures' scrub once read its first two objects as lost).
        s3_connect_timeout_s=5.0,
    )
    base.update(kw)
    return KvstoreConfig(**base)


@pytest.fixture
def make_server(locations, tmp_path, clock):
    """Factory: start a kvstore (in-process, real gRPC socket) on this test's buckets."""
    started: list[ServerThread] = []

    def make(**kw) -> ServerThread:
        kw.setdefault("data_dir", tmp_path / "kv")
        cfg = make_config(kw.pop("locations", locations), **kw)
        srv = ServerThread(cfg, clock=clock).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def kv(make_server):
    return make_server()


def call(address: str, fn, timeout: float | None = 30.0):
    """Run `await fn(client)` against the server at `address` in a fresh loop."""
    async def go():
        async with KvstoreClient(address, timeout=timeout) as client:
            return await fn(client)

    return asyncio.run(go())


def hexkey(i: int, width: int = 64) -> str:
    return f"{i:0{width}x}"
