"""EngineService servicer: converts messages, forwards to AsyncEngine. Nothing else."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

from kvmesh.errors import InvalidArgument
from kvmesh.generation import (
    DEFAULT_MAX_TOKENS,
    SAMPLING_CONTROLS,
    finish_to_proto,
    sampling_controls,
    traffic_class_name,
)
from kvmesh.metrics import GenerationTimes, RequestMetrics
from kvmesh.proto import common_pb2, engine_pb2, engine_pb2_grpc
from kvmesh.rpc import map_errors
from kvmesh.services.engine.core.async_engine import AsyncEngine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.rpc import handoff_transfer as handoff_rpc
from kvmesh.services.engine.rpc.peers import check_key, snapshot_messages
from kvmesh.services.engine.rpc.session import SessionHub


def params_from_proto(req) -> SamplingParams:
    s = req.sampling
    temperature = s.temperature if s.HasField("temperature") else 1.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if math.isnan(top_p):
        raise InvalidArgument("top_p must be in (0, 1], got nan")
    return SamplingParams(
        temperature=temperature,
        top_k=s.top_k,
        top_p=top_p,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop_token_ids=tuple(req.stop_token_ids),
        stop=tuple(req.stop),
        ignore_eos=req.ignore_eos,
        speculative=s.speculative if s.HasField("speculative") else "",
        **{name: SAMPLING_CONTROLS[name] if value is None else value
           for name, value in sampling_controls(s).items()},
    )


def usage_proto(ev) -> common_pb2.Usage:
    """Usage of a finished generation from its last Event."""
    seq = ev.seq
    return common_pb2.Usage(prompt_tokens=len(seq.prompt), cached_tokens=seq.cached_tokens,
                            replayed_tokens=seq.replayed_tokens, generated_tokens=len(seq.output),
                            drafted_tokens=ev.drafted, accepted_tokens=ev.accepted)


HANDOFF_TIMEOUT_S = 30.0     # one fetch of a handoff (under 1 MB on the shipped model, a few MB on V4.1-Flash plus its blocks)


class _Fetched:
    """A decode engine's last event of an adopted request, with the bytes it fetched."""

    def __init__(self, ev, fetched: int):
        self.__dict__.update(ev.__dict__)
        self.fetched = fetched


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, engine: AsyncEngine, remote=None, engine_id: str = ""):
        self.engine = engine
        self.engine_id = engine_id      # answered in GetModelInfo (the gateway's identity check)
        self.remote = remote            # RemoteTiers: kvstore blocks and peer snapshots
        self.tokenizer = engine.core.tokenizer
        self.metrics = RequestMetrics("engine")   # tokens; RPC counts come from the interceptor
        self.sessions = SessionHub(self.events)

    def prompt_ids(self, req) -> list[int]:
        if req.prompt_token_ids:
            return list(req.prompt_token_ids)
        return self.tokenizer.encode(req.prompt)

    @map_errors
    async def Generate(self, request, context):
        async for msg in self.events(request):
            yield msg

    async def Session(self, request_iterator, context):
        # Errors are per generation (SessionError), so no map_errors around the stream.
        async for msg in self.sessions.serve(request_iterator):
            yield msg

    async def events(self, request) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The messages of one generation, for Generate and for a Session alike.

        Counts kvmesh_tokens_total{service="engine"} as the gateway does: every token sent
        as generated (an aborted generation's too), prompt/cached/replayed from the usage
        of a generation that finished, and vLLM's latency histograms (kvmesh/metrics.py)."""
        times = GenerationTimes(self.engine.core.cfg.name)     # from the call's arrival
        if request.HasField("handoff_from"):
            stream = await self._adopted(request.handoff_from)
        else:
            params = params_from_proto(request)
            ids = self.prompt_ids(request)
            prefetched = None
            if self.remote is not None and ids:
                prefetched = await self.remote.prefetch(ids, request.cache_salt)
            traffic_class = traffic_class_name(request.traffic_class)   # checked by the core
            stream = self.engine.generate(ids, params, request.request_id, request.cache_salt,
                                          traffic_class, prefetched, request.resume_generated,
                                          request.handoff)
        generated, usage, finish = 0, None, ""
        try:
            async for ev in stream:
                msg = engine_pb2.GenerateResponse(request_id=ev.request_id,
                                                  token_ids=ev.token_ids, text=ev.text)
                if ev.logprobs:
                    msg.logprobs.extend(lp.to_proto() for lp in ev.logprobs)
                generated += len(ev.token_ids)
                times.scheduled(getattr(ev.seq, "scheduled_s", 0.0))
                times.token(len(ev.token_ids))
                if ev.finish is not None:
                    finish = ev.finish.value
                    msg.finish_reason = finish_to_proto(ev.finish.value)
                    usage = usage_proto(ev)
                    msg.usage.CopyFrom(usage)
                if isinstance(ev, _Fetched):          # a decode engine: bytes it fetched
                    msg.handoff.total_bytes = ev.fetched
                elif ev.handoff is not None:          # a prefill engine: what it holds
                    msg.handoff.CopyFrom(handoff_rpc.handoff_info(ev.handoff))
                yield msg
        finally:
            if usage is not None:                 # vLLM counts finished generations only
                times.done(usage.drafted_tokens, usage.accepted_tokens, finish)
            counts = {"generated": generated}
            if usage is not None:
                counts.update(prompt=usage.prompt_tokens, cached=usage.cached_tokens,
                              replayed=usage.replayed_tokens)
            self.metrics.count_tokens(counts)

    async def _adopted(self, src):
        """Fetch (checked) the handoff `src` names and continue it here; Unavailable when the
        transfer fails or is refused, so the gateway tries another engine."""
        handoff_rpc.check_source(src)
        core = self.engine.core
        hashes = list(src.block_hashes)
        skip = await self.engine.call(lambda c: c.held_blocks(hashes))
        try:
            h, seconds = await handoff_rpc.fetch_handoff(
                src, params_from_proto, HANDOFF_TIMEOUT_S, core.prefix.layout_fp,
                core.cfg.fingerprint(), core.handoff_state_bytes, core.handoff_max_bytes,
                skip, core.block_bytes)
        except Exception:
            self.engine.post(lambda c: c.counters.update(handoff_refused=1))
            raise
        self.engine.post(lambda c: c.counters.update(handoff_fetch_ms=int(seconds * 1000)))
        return self._with_fetched(self.engine.adopt(h), h.nbytes)

    @staticmethod
    async def _with_fetched(events, nbytes: int):
        """An adopted request's events; the last one says what was fetched (HandoffInfo)."""
        async for ev in events:
            yield ev if ev.finish is None else _Fetched(ev, nbytes)

    @map_errors
    async def FetchHandoff(self, request, context):
        rid = request.request_id
        h = await self.engine.call(lambda core: core.handoffs.get(rid))
        for msg in handoff_rpc.handoff_messages(h, rid, request.skip):
            yield msg

    @map_errors
    async def GetModelInfo(self, request, context):
        core = self.engine.core
        return engine_pb2.GetModelInfoResponse(
            preset=core.cfg.name, model_config_json=core.cfg.to_json(),
            model_fingerprint=core.cfg.fingerprint(),
            layout_fingerprint=core.prefix.layout_fp,
            block_size=core.cfg.block_size, tokenizer=getattr(core.tokenizer, "path", "byte"),
            max_seq_len=core.cfg.max_seq_len, engine_id=self.engine_id)

    @map_errors
    async def FetchSwaSnapshot(self, request, context):
        check_key(request.key)
        snap = await self.engine.call(lambda core: core.prefix.store.peek(request.key))
        for msg in snapshot_messages(snap, request.key):
            yield msg

    @map_errors
    async def GetStats(self, request, context):
        stats = await self.engine.call(lambda core: core.stats())
        return engine_pb2.GetStatsResponse(counters=stats)
