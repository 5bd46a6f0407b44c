"""EngineService.Session over a real gRPC socket: many generations on one stream give the
same messages as one Generate call each; errors, cancels and a closed stream stay per
generation and free what they held; a draining engine refuses new work."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import Server
from kvmesh.services.engine.rpc.client import generate_request
from kvmesh.services.engine.rpc.server import SERVICE_NAME
from kvmesh.services.engine.rpc.service import EngineServicer
from tests.engine.rpc.test_service import EngineHarness, wait_idle


class SessionHarness(EngineHarness):
    async def _server(self):
        server = Server("127.0.0.1:0", [SERVICE_NAME])
        self.servicer = EngineServicer(self.engine)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, server.server)
        await server.start()
        return server


@pytest.fixture(scope="module")
def h():
    harness = SessionHarness(num_slots=4, num_blocks=256)
    yield harness
    harness.close()


class Session:
    """A raw Session stream: send(tag, request) / cancel(tag), and every response by tag."""

    def __init__(self, stub):
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = stub.Session(self._requests())
        self.by_tag: dict[int, list] = {}
        self.done: dict[int, asyncio.Event] = {}

    async def _requests(self):
        while (msg := await self.outbox.get()) is not None:
            yield msg

    def send(self, tag: int, req) -> None:
        self.done.setdefault(tag, asyncio.Event())
        self.outbox.put_nowait(engine_pb2.SessionRequest(tag=tag, generate=req))

    def cancel(self, tag: int) -> None:
        self.outbox.put_nowait(engine_pb2.SessionRequest(tag=tag, cancel=True))

    async def pump(self) -> None:
        """Read responses until the stream ends."""
        async for msg in self.call:
            self.by_tag.setdefault(msg.tag, []).append(msg)
            if msg.WhichOneof("part") == "error" or msg.event.finish_reason:
                self.done.setdefault(msg.tag, asyncio.Event()).set()

    async def wait(self, *tags: int, timeout: float = 60) -> None:
        await asyncio.wait_for(asyncio.gather(*(self.done[t].wait() for t in tags)), timeout)


def events(msgs) -> list[tuple]:
    """What a client sees of a generation, minus the request id (each path makes its own)."""
    return [(list(m.token_ids), m.text, m.finish_reason,
             (m.usage.prompt_tokens, m.usage.cached_tokens, m.usage.generated_tokens))
            for m in msgs]


REQUESTS = [
    dict(prompt="the first prompt", max_tokens=12, temperature=0.0),
    dict(prompt=[3, 1, 4, 1, 5, 9, 2, 6] * 5, max_tokens=20, temperature=0.8, seed=11),
    dict(prompt="a third one, sampled", max_tokens=7, temperature=1.0, top_k=5, seed=3),
    dict(prompt=[7] * 70, max_tokens=15, temperature=0.0, ignore_eos=True),
]


def test_interleaved_generations_equal_one_generate_call_each(h):
    async def go():
        plain = []
        for kw in REQUESTS:
            plain.append(events([m async for m in h.client.stub.Generate(generate_request(**kw))]))
        s = Session(h.client.stub)
        pump = asyncio.create_task(s.pump())
        for tag, kw in enumerate(REQUESTS, start=100):  # all four run at once on one stream
            s.send(tag, generate_request(**kw))
        await s.wait(*range(100, 100 + len(REQUESTS)))
        s.outbox.put_nowait(None)
        await asyncio.wait_for(pump, 10)  # input closed, nothing running: the stream ends
        return plain, [events([m.event for m in s.by_tag[t]])
                       for t in range(100, 100 + len(REQUESTS))]

    plain, multiplexed = h.run(go())
    assert multiplexed == plain
    assert all(e[-1][2] != 0 for e in plain)  # each ended with a finish reason


def test_errors_are_per_generation_and_the_session_keeps_serving(h):
    async def go():
        s = Session(h.client.stub)
        pump = asyncio.create_task(s.pump())
        s.send(1, generate_request("x", max_tokens=0))
        s.send(2, generate_request("fine", max_tokens=3, temperature=0.0))
        s.send(3, generate_request("x", temperature=-1.0))
        s.outbox.put_nowait(engine_pb2.SessionRequest(tag=4))  # neither generate nor cancel
        s.done[4] = asyncio.Event()
        await s.wait(1, 2, 3, 4)
        s.send(5, generate_request("after the errors", max_tokens=2, temperature=0.0))
        await s.wait(5)
        s.outbox.put_nowait(None)
        await asyncio.wait_for(pump, 10)
        return s.by_tag

    got = h.run(go())
    for tag, text in ((1, "max_tokens must be > 0"), (3, "temperature"), (4, "generate")):
        (msg,) = got[tag]
        assert msg.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], tag
        assert text in msg.error.message
    assert sum(len(m.event.token_ids) for m in got[2]) == 3
    assert sum(len(m.event.token_ids) for m in got[5]) == 2


def test_duplicate_tag_is_refused_while_it_runs(h):
    async def go():
        s = Session(h.client.stub)
        pump = asyncio.create_task(s.pump())
        s.send(9, generate_request([5] * 40, max_tokens=300, temperature=0.0, ignore_eos=True))
        s.send(9, generate_request("again", max_tokens=2))
        while not any(m.WhichOneof("part") == "error" for m in s.by_tag.get(9, [])):
            await asyncio.sleep(0.01)
        s.cancel(9)
        s.outbox.put_nowait(None)
        await asyncio.wait_for(pump, 20)
        return s.by_tag[9]

    errors = [m for m in h.run(go()) if m.WhichOneof("part") == "error"]
    assert len(errors) == 1 and "already running" in errors[0].error.message


def test_cancel_frees_the_slot_and_the_stream_goes_on(h):
    async def go():
        s = Session(h.client.stub)
        pump = asyncio.create_task(s.pump())
        s.send(1, generate_request([5] * 300, max_tokens=400, temperature=0.0, ignore_eos=True))
        while len(s.by_tag.get(1, [])) < 3:
            await asyncio.sleep(0.01)
        s.cancel(1)
        stats = await wait_idle(h)
        s.send(2, generate_request("next", max_tokens=4, temperature=0.0))
        await s.wait(2)
        s.outbox.put_nowait(None)
        await asyncio.wait_for(pump, 10)
        return stats, s.by_tag

    stats, got = h.run(go())
    assert stats["slots_in_use"] == 0 and stats["blocks_in_use"] == 0
    assert not any(m.event.finish_reason for m in got[1])  # it never finished
    assert sum(len(m.event.token_ids) for m in got[2]) == 4


def test_closing_the_stream_aborts_what_runs_on_it(h):
    async def go():
        aborted0 = (await h.client.stats())["aborted"]
        s = Session(h.client.stub)
        pump = asyncio.create_task(s.pump())
        for tag in (1, 2):
            s.send(tag, generate_request([tag] * 200, max_tokens=400, temperature=0.0,
                                         ignore_eos=True))
        while min(len(s.by_tag.get(t, [])) for t in (1, 2)) < 2:
            await asyncio.sleep(0.01)
        s.call.cancel()  # the caller goes away mid-generation
        pump.cancel()
        stats = await wait_idle(h)
        return stats, stats["aborted"] - aborted0

    stats, aborted = h.run(go())
    assert aborted == 2
    assert stats["slots_in_use"] == 0 and stats["blocks_in_use"] == 0


def test_draining_engine_refuses_new_generations_and_ends_the_stream(h):
    async def go():
        s = Session(h.client.stub)
        pump = asyncio.create_task(s.pump())
        s.send(1, generate_request([4] * 30, max_tokens=40, temperature=0.0, ignore_eos=True))
        while not s.by_tag.get(1):
            await asyncio.sleep(0.01)
        h.servicer.sessions.drain()
        s.send(2, generate_request("too late", max_tokens=2))
        await s.wait(1, 2)
        await asyncio.wait_for(pump, 10)  # ends without the caller closing its side
        return s.by_tag

    try:
        got = h.run(go())
    finally:
        h.servicer.sessions.draining = False
    assert got[1][-1].event.finish_reason and sum(len(m.event.token_ids) for m in got[1]) == 40
    (refused,) = got[2]
    assert refused.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "shutting down" in refused.error.message


def test_tags_beyond_the_limit_are_refused(h, monkeypatch):
    from kvmesh.services.engine.rpc import session as session_mod

    monkeypatch.setattr(session_mod, "MAX_TAGS", 2)

    async def go():
        s = Session(h.client.stub)
        pump = asyncio.create_task(s.pump())
        for tag in (1, 2, 3):
            s.send(tag, generate_request([tag] * 20, max_tokens=60, temperature=0.0,
                                         ignore_eos=True))
        await s.wait(1, 2, 3)
        s.outbox.put_nowait(None)
        await asyncio.wait_for(pump, 10)
        return s.by_tag

    got = h.run(go())
    (refused,) = got[3]
    assert refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "the limit is 2" in refused.error.message
    assert all(sum(len(m.event.token_ids) for m in got[t]) == 60 for t in (1, 2))
