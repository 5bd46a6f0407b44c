"""EngineSession: the gateway's one Session stream to one engine (see
services/engine/rpc/session.py for the engine side and why it exists).

Every request the gateway sends to that engine is a tagged generation on the
stream. The session owns the call, the outgoing queue and the tag -> inbox map;
only the event loop that opened it touches them. Its reader task hands each
SessionResponse to the inbox of its tag. When the stream breaks (engine gone,
connection lost), every open generation on it gets the failure and the session
is `broken`: `EnginePool` opens a new one for the next request.

A generation that ends early (client cancelled, deadline, the core gave up)
sends `cancel` for its tag, so the engine aborts it and frees its slot and
blocks, as cancelling a Generate call does. Deadlines are timers on the inbox:
when one fires the generation raises DeadlineExceeded and cancels its tag.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import grpc

from kvmesh.errors import InvalidArgument
from kvmesh.generation import TokenLogprob, finish_name
from kvmesh.proto import engine_pb2
from kvmesh.services.gateway.model import (
    Chunk,
    DeadlineExceeded,
    EngineFailure,
    EngineInternal,
    HandoffInfo,
    Usage,
)

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def error_for(address: str, code: grpc.StatusCode, details: str) -> Exception:
    """The domain error for an engine's gRPC status (a call's, or a session tag's)."""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(details)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"deadline exceeded while engine {address} was generating")
    if code is grpc.StatusCode.INTERNAL:
        return EngineInternal(f"engine {address}: {details}")
    return EngineFailure(f"{code.name}: {details}")


def to_chunk(m: engine_pb2.GenerateResponse) -> Chunk:
    logprobs = tuple(TokenLogprob.from_proto(lp) for lp in m.logprobs)
    if not m.finish_reason:
        return Chunk(list(m.token_ids), m.text, logprobs=logprobs)
    u = m.usage
    handoff = HandoffInfo(m.handoff.total_bytes, m.handoff.sha256,
                          tuple(m.handoff.block_hashes)) if m.HasField("handoff") else None
    return Chunk(list(m.token_ids), m.text, finish_name(m.finish_reason) or "aborted",
                 Usage(u.prompt_tokens, u.cached_tokens, u.replayed_tokens, u.generated_tokens,
                       drafted_tokens=u.drafted_tokens, accepted_tokens=u.accepted_tokens),
                 handoff, logprobs)


class EngineSession:
    def __init__(self, stub, address: str):
        self.address = address
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._inboxes: dict[int, asyncio.Queue] = {}
        self._tags = itertools.count(1)
        self.broken: Exception | None = None
        self._call = stub.Session(self._requests(), wait_for_ready=False)
        self._reader = asyncio.create_task(self._read())

    async def _requests(self):
        while True:
            msg = await self._outbox.get()
            if msg is None:
                return
            yield msg

    async def _read(self) -> None:
        try:
            async for msg in self._call:
                inbox = self._inboxes.get(msg.tag)
                if inbox is not None:
                    inbox.put_nowait(msg)
            err: Exception = EngineFailure(f"engine {self.address} closed the session")
        except grpc.aio.AioRpcError as exc:  # the stream itself failed: the engine is lost
            err = EngineFailure(f"{exc.code().name}: {exc.details()}")
        except asyncio.CancelledError:
            self._fail(EngineFailure("session closed by the gateway"))
            raise
        self._fail(err)

    def _fail(self, err: Exception) -> None:
        self.broken = err
        for inbox in self._inboxes.values():
            inbox.put_nowait(err)

    async def generate(self, msg: engine_pb2.GenerateRequest,
                       timeout: float | None) -> AsyncIterator[Chunk]:
        """Chunks of one generation; the last has `finish` set. Raises the domain error
        the engine reported, EngineFailure when the stream broke, DeadlineExceeded."""
        if self.broken is not None:
            raise self.broken
        tag = next(self._tags)
        inbox: asyncio.Queue = asyncio.Queue()
        self._inboxes[tag] = inbox
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(
                timeout, inbox.put_nowait, DeadlineExceeded(
                    f"deadline exceeded while engine {self.address} was generating"))
        self._outbox.put_nowait(engine_pb2.SessionRequest(tag=tag, generate=msg))
        ended = False  # the engine is done with this tag: nothing to cancel
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, Exception):
                    ended = isinstance(item, EngineFailure)
                    raise item
                if item.WhichOneof("part") == "error":
                    ended = True
                    code = _CODES.get(item.error.code, grpc.StatusCode.UNKNOWN)
                    raise error_for(self.address, code, item.error.message)
                chunk = to_chunk(item.event)
                if chunk.finish is not None:
                    ended = True
                    yield chunk
                    return
                yield chunk
        finally:
            if timer is not None:
                timer.cancel()
            self._inboxes.pop(tag, None)
            if not ended and self.broken is None:
                self._outbox.put_nowait(engine_pb2.SessionRequest(tag=tag, cancel=True))

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
