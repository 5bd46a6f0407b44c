"""EnginePool: the gateway's gRPC side towards engines (one channel per address).

Turns a `GenRequest` into an engine GenerateRequest, streams `Chunk`s back and
translates gRPC failures into domain errors the core decides on:

    INVALID_ARGUMENT        -> InvalidArgument (engine's message unchanged)
    DEADLINE_EXCEEDED       -> DeadlineExceeded
    INTERNAL                -> EngineInternal (a bug: not retried, not hidden)
    anything else           -> EngineFailure (retryable before the first token)

Generations go over one `EngineSession` stream per engine (session.py): a
message on an open stream instead of a new gRPC call per request. The plain
path, one Generate call per request, stays behind `EnginePool(session=False)`
(gateway `--engine-calls`) as the reference the session path is tested against.

The pool owns its channels and sessions; `close()` closes them. A generation
that is closed early (client cancelled, deadline, core gave up) cancels its
engine call or session tag, so the engine aborts the request and frees its slot
and blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvmesh.generation import set_sampling, traffic_class_to_proto
from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import channel
from kvmesh.services.gateway.model import Chunk, EngineFailure, GenRequest
from kvmesh.services.gateway.session import EngineSession, error_for, to_chunk


def engine_request(req: GenRequest) -> engine_pb2.GenerateRequest:
    msg = engine_pb2.GenerateRequest(
        request_id=req.request_id, cache_salt=req.cache_salt,
        traffic_class=traffic_class_to_proto(req.traffic_class),
        ignore_eos=req.ignore_eos, stop=req.stop, stop_token_ids=req.stop_token_ids)
    if req.prompt_token_ids is not None:
        msg.prompt_token_ids.extend(req.prompt_token_ids)
    else:
        msg.prompt = req.prompt
    return set_sampling(msg, req.max_tokens, req.temperature, req.top_k, req.top_p, req.seed,
                        req.speculative, **req.controls())


def resume_request(msg: engine_pb2.GenerateRequest, prompt_ids: list[int],
                   generated: list[int]) -> engine_pb2.GenerateRequest:
    """The engine request that continues `msg` after `generated` tokens were sent: the
    prompt grows by them and the engine resumes at their position (same seed, same
    max_tokens, stop state rebuilt from them), so the client's stream goes on as one."""
    out = engine_pb2.GenerateRequest()
    out.CopyFrom(msg)
    out.ClearField("prompt")
    del out.prompt_token_ids[:]
    out.prompt_token_ids.extend([*prompt_ids, *generated])
    out.resume_generated = len(generated)
    return out


class EnginePool:
    """`session=True` (the default) sends generations over one Session stream per engine;
    False makes one Generate call per request (the plain path, kept for comparison)."""

    def __init__(self, session: bool = True):
        self.use_sessions = session
        self._stubs: dict[str, tuple[grpc.aio.Channel, engine_pb2_grpc.EngineServiceStub]] = {}
        self._sessions: dict[str, EngineSession] = {}

    def stub(self, address: str) -> engine_pb2_grpc.EngineServiceStub:
        entry = self._stubs.get(address)
        if entry is None:
            ch = channel(address)
            entry = self._stubs[address] = (ch, engine_pb2_grpc.EngineServiceStub(ch))
        return entry[1]

    def connectable(self, address: str) -> bool:
        """False when the last try to connect to `address` failed (nothing listens there:
        its process is gone); asks the channel to connect if it is idle. No RPC is sent."""
        self.stub(address)
        state = self._stubs[address][0].get_state(try_to_connect=True)
        return state != grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def session(self, address: str) -> EngineSession:
        """The open session to `address`; a new one when there is none or it broke."""
        s = self._sessions.get(address)
        if s is None or s.broken is not None:
            s = self._sessions[address] = EngineSession(self.stub(address), address)
        return s

    def stream(self, address: str, msg: engine_pb2.GenerateRequest,
               timeout: float | None) -> AsyncIterator[Chunk]:
        """Chunks of one generation; the last has `finish` set, else an error is raised."""
        if self.use_sessions:
            return self.session(address).generate(msg, timeout)
        return self._call(address, msg, timeout)

    async def _call(self, address: str, msg: engine_pb2.GenerateRequest,
                    timeout: float | None) -> AsyncIterator[Chunk]:
        call = self.stub(address).Generate(msg, timeout=timeout, wait_for_ready=False)
        finished = False
        try:
            while True:
                m = await call.read()
                if m is grpc.aio.EOF:
                    break
                chunk = to_chunk(m)
                if chunk.finish is not None:
                    finished = True
                    yield chunk
                    return
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise error_for(address, exc.code(), exc.details()) from None
        finally:
            if not finished:
                call.cancel()  # the engine sees the call end and aborts the request
        raise EngineFailure("stream ended without a finish reason")

    async def model_info(self, address: str, timeout: float = 2.0):
        try:
            return await self.stub(address).GetModelInfo(engine_pb2.GetModelInfoRequest(),
                                                         timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise error_for(address, exc.code(), exc.details()) from None

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()
        for ch, _ in self._stubs.values():
            await ch.close()
        self._stubs.clear()
