"""EngineService over a real gRPC socket: streaming, bad input, cancellation, health."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.proto import engine_pb2_grpc
from kvmesh.rpc import Server
from kvmesh.services.engine.core.async_engine import AsyncEngine
from kvmesh.services.engine.rpc.client import EngineClient, generate_request
from kvmesh.services.engine.rpc.server import SERVICE_NAME
from kvmesh.services.engine.rpc.service import EngineServicer
from tests.engine.engines import serve_core
from tests.loop import LoopThread


class EngineHarness(LoopThread):
    """An engine server and a client on one event loop in a background thread."""

    def __init__(self, **settings):
        """`settings`: engine serve's flags by name (num_slots=4 is --num-slots 4)."""
        super().__init__()
        flags = [x for k, v in settings.items() for x in ("--" + k.replace("_", "-"), str(v))]
        self.core = serve_core(*flags)
        self.engine = AsyncEngine(self.core)
        self.server = self.run(self._server())
        self.address = f"127.0.0.1:{self.server.port}"
        self.client = self.make(EngineClient, self.address)

    async def _server(self):
        server = Server("127.0.0.1:0", [SERVICE_NAME])   # grpc.aio binds to the running loop
        engine_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(self.engine),
                                                            server.server)
        await server.start()
        return server

    def close(self):
        self.run(self.client.close())
        self.run(self.server.stop(0.1))
        self.engine.shutdown()
        super().close()


async def wait_idle(h, tries: int = 200) -> dict:
    """Engine stats once nothing runs or waits, after a ledger integrity check."""
    for _ in range(tries):
        stats = await h.client.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            await h.engine.call(lambda core: core.check_integrity())
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError("engine did not become idle (request not aborted?)")


@pytest.fixture(scope="module")
def h():
    harness = EngineHarness(num_slots=4, num_blocks=256)
    yield harness
    harness.close()


def test_stream_and_usage(h):
    ids, text, last = h.run(h.client.complete("hello engine", max_tokens=9, temperature=0.0))
    assert len(ids) == 9
    assert last.finish_reason == 1  # LENGTH
    assert last.usage.prompt_tokens == len(h.core.tokenizer.encode("hello engine"))
    assert last.usage.generated_tokens == 9


def test_greedy_is_repeatable_and_seeded_sampling_too(h):
    a = h.run(h.client.complete([1, 2, 3, 4], max_tokens=8, temperature=0.0))[0]
    b = h.run(h.client.complete([1, 2, 3, 4], max_tokens=8, temperature=0.0))[0]
    assert a == b
    c = h.run(h.client.complete([1, 2, 3, 4], max_tokens=8, temperature=1.0, seed=5))[0]
    d = h.run(h.client.complete([1, 2, 3, 4], max_tokens=8, temperature=1.0, seed=5))[0]
    assert c == d


BAD = [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[1] * 70_000), "exceeds the model's maximum"),
    (dict(prompt="x", max_tokens=0), "max_tokens must be > 0"),
    (dict(prompt="x", max_tokens=-3), "max_tokens must be > 0"),
    (dict(prompt="x", temperature=-0.5), "temperature"),
    (dict(prompt="x", temperature=math.nan), "temperature"),
    (dict(prompt="x", temperature=math.inf), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_p=math.nan), "top_p"),
    (dict(prompt=[1, 999_999]), "outside"),
    (dict(prompt="x", traffic_class=7), "traffic_class"),   # a number outside the enum
    (dict(prompt="x", stop=[""]), "stop strings"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_invalid_argument_and_engine_keeps_serving(h, kwargs, message):
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        h.run(h.client.complete(prompt, **kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    ids, _, _ = h.run(h.client.complete("still alive", max_tokens=2, temperature=0.0))
    assert len(ids) == 2


def test_cancelled_request_frees_its_slot_and_blocks(h):
    async def start_and_cancel():
        call = h.client.stub.Generate(generate_request([5] * 300, max_tokens=400, temperature=0.0,
                                                       ignore_eos=True))
        got = 0
        async for _ in call:
            got += 1
            if got == 3:
                call.cancel()
                break
        return got

    assert h.run(start_and_cancel()) == 3
    stats = h.run(wait_idle(h))
    assert stats["slots_in_use"] == 0 and stats["blocks_in_use"] == 0
    assert stats["aborted"] >= 1


def test_deadline_reaches_the_engine(h):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        h.run(h.client.complete([7] * 200, max_tokens=500, temperature=0.0, ignore_eos=True,
                                timeout=0.3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_health_and_reflection(h):
    async def check():
        health = health_pb2_grpc.HealthStub(h.client.channel)
        r = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        refl = reflection_pb2_grpc.ServerReflectionStub(h.client.channel)

        async def reqs():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for resp in refl.ServerReflectionInfo(reqs()):
            names = [s.name for s in resp.list_services_response.service]
            break
        return r.status, names

    status, names = h.run(check())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


def test_model_info_names_cache_contents(h):
    info = h.run(h.client.model_info())
    assert info.block_size == 128 and info.model_fingerprint == h.core.cfg.fingerprint()
    assert len(info.layout_fingerprint) == 16
