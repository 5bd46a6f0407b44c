"""A real mesh without the gateway: Valkey, directory, SeaweedFS + kvstore, two engines.

Every component is its own process on loopback, started once per module; tests
talk to the engines over gRPC and stop or kill components to show failure
behaviour. Engines run the tiny model with YOCO truncation (KEEP 134).
"""

from __future__ import annotations

import sys

import pytest

from kvmesh.directory_client import DirectoryClient
from kvmesh.healthcheck import wait_healthy
from kvmesh.launch.backing.proc import ManagedProcess, free_port
from kvmesh.launch.backing.seaweed import start_seaweed_cluster
from kvmesh.launch.backing.valkey import ValkeyProcess
from kvmesh.services.engine.rpc.client import EngineClient
from kvmesh.services.kvstore.client import KvstoreClient
from tests.loop import LoopThread

KVMESH = [sys.executable, "-m", "kvmesh.launch.cli"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Tiers:
    def __init__(self, tmp):
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.procs: dict[str, ManagedProcess] = {}
        self.valkey = ValkeyProcess(work_dir=tmp / "valkey").start()
        self.cluster = start_seaweed_cluster(2, [6, 6], tmp / "seaweed")
        self.ports = {n: free_port() for n in ("directory", "kvstore", "a", "b")}
        self.addr = {n: f"127.0.0.1:{p}" for n, p in self.ports.items()}
        self._spawn("directory", ["directory", "serve", "--host", "127.0.0.1",
                                  "--port", str(self.ports["directory"]),
                                  "--redis-url", self.valkey.url, "--lease-ttl-s", "3"])
        self._spawn("kvstore", ["kvstore", "serve", "--host", "127.0.0.1",
                                "--port", str(self.ports["kvstore"]),
                                "--locations", ",".join(self.cluster.locations),
                                "--data-dir", str(tmp / "kvstore")])
        for name in ("a", "b"):
            self.start_engine(name)
        for name in self.procs:
            wait_healthy(self.addr[name], 120, self.procs[name])
        self.loop = LoopThread()
        self.engines = {n: self.loop.make(EngineClient, self.addr[n]) for n in "ab"}
        self.directory = self.loop.make(DirectoryClient, self.addr["directory"])
        self.kvstore = self.loop.make(KvstoreClient, self.addr["kvstore"])

    def _spawn(self, name, argv):
        self.procs[name] = ManagedProcess(name, KVMESH + argv, self.logs, ENV).start()

    def start_engine(self, name, wait=False):
        self._spawn(name, ["engine", "serve", "--host", "127.0.0.1", "--port", str(self.ports[name]),
                           "--engine-id", f"engine-{name}",
                           "--truncation", "compact", "--keep-tokens", "134",
                           "--num-slots", "4", "--num-blocks", "96",
                           "--directory", self.addr["directory"], "--kvstore", self.addr["kvstore"],
                           "--fetch-deadline-ms", "1500"])
        if wait:
            wait_healthy(self.addr[name], 120, self.procs[name])

    def generate(self, engine, prompt, max_tokens=8, timeout=60):
        return self.loop.run(self.engines[engine].complete(prompt, max_tokens=max_tokens,
                                                           temperature=0.0, ignore_eos=True,
                                                           timeout=timeout))

    def stats(self, engine):
        return self.loop.run(self.engines[engine].stats())

    def close(self):
        for c in [*self.engines.values(), self.directory, self.kvstore]:
            try:
                self.loop.run(c.close(), timeout=5)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.loop.close()
        for p in self.procs.values():
            p.stop()
        self.cluster.stop()
        self.valkey.close()


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    t = Tiers(tmp_path_factory.mktemp("tiers"))
    yield t
    t.close()
