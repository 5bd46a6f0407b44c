"""Shared pieces for gateway tests: a mesh per module (the same `Mesh` as `kvmesh up`)
and small synchronous gRPC helpers.

Tests talk to the gateway with the *sync* grpc API: a streaming call is an
iterator with `.cancel()`, which keeps cancellation tests short.
"""

from __future__ import annotations

import time

import grpc
import pytest

from kvmesh.launch.mesh import Mesh, MeshConfig
from kvmesh.proto import engine_pb2, engine_pb2_grpc, gateway_pb2_grpc
from kvmesh.services.gateway.client import gateway_request
from kvmesh.shipped import DEFAULT_MODEL
from kvmesh.tokenizer import HFTokenizer

# Small engines: 2 cores run two engines, a directory, valkey and the gateway.
# A generous peer-fetch deadline: a loaded 2-core box must not turn a fetch into a replay.
# The shipped model (DeepSeek V4.1's layout, BPE tokens) under prefill truncation compact /
# KEEP 134 (MeshConfig's "auto", as `kvmesh up`, docker-compose.yml and deploy/k8s serve
# it): snapshots are taken and a hit resumes exactly.
TEST_MESH = dict(engines=2, num_slots=4, num_blocks=64, model=str(DEFAULT_MODEL),
                 engine_extra=("--fetch-deadline-ms", "5000"))


# What the gateway and the engines count and route in: the served model's tokenizer.
TOKENIZER = HFTokenizer(DEFAULT_MODEL / "tokenizer.json")


def tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def start_mesh(tmp_path_factory, name: str, **overrides) -> Mesh:
    cfg = MeshConfig(log_dir=tmp_path_factory.mktemp(name) / "logs", **{**TEST_MESH, **overrides})
    return Mesh(cfg).start()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, request):
    """One mesh per module; a module may set MESH_OVERRIDES (MeshConfig fields)."""
    overrides = getattr(request.module, "MESH_OVERRIDES", {})
    m = start_mesh(tmp_path_factory, request.module.__name__.rsplit(".", 1)[-1], **overrides)
    try:
        yield m
    finally:
        m.stop()
        left = [p for p in m.procs.values() if p.alive]
        assert not left, f"processes left running: {[p.name for p in left]}"


class Gw:
    """Sync stub for the gateway plus engine stubs, one channel each."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.channel = grpc.insecure_channel(mesh.gateway)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    def generate(self, prompt, timeout=60, **kw):
        return self.stub.Generate(gateway_request(prompt, **kw), timeout=timeout)

    def stream(self, prompt, timeout=60, **kw):
        return self.stub.GenerateStream(gateway_request(prompt, **kw), timeout=timeout)

    def engine_stats(self, name: str) -> dict[str, float]:
        with grpc.insecure_channel(self.mesh.endpoints[name]) as ch:
            stub = engine_pb2_grpc.EngineServiceStub(ch)
            return dict(stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10).counters)

    def close(self):
        self.channel.close()


@pytest.fixture(scope="module")
def gw(mesh):
    g = Gw(mesh)
    yield g
    g.close()


def wait_for(pred, timeout: float = 15.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="module")
def channels():
    """Sync channels by address, for raw calls (tests/gateway/rpc_table.py)."""
    opened: dict[str, grpc.Channel] = {}
    yield opened
    for ch in opened.values():
        ch.close()


@pytest.fixture(scope="module")
def base(mesh):
    """The module's mesh's OpenAI-compatible HTTP API."""
    return mesh.endpoints["gateway-http"]


@pytest.fixture(scope="module")
def client(base):
    """The official `openai` client on it (no retries: a test sees every error)."""
    import openai

    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
