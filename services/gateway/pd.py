"""Prefill/decode disaggregation at the gateway: one request, two engines, one stream.

    1. prefill: pick a prefill engine (PE) among `prefill_engines` by the routing rules
       (snapshot holder, prefix affinity, load); send the request with `handoff`; its last
       message carries the first token (sent to the client at once) and HandoffInfo.
       A PE that fails first (no token was sent): mark it down, try another PE, up to
       `max_attempts`; then PdFailed with nothing sent.
    2. decode: pick a decode engine (CE) among `decode_engines` (affinity: the CE that
       decoded this prefix before holds its blocks; then load) and send it `handoff_from`
       (PE address, request id, size, sha256). The CE fetches the handoff from the PE,
       checks it and decodes; its chunks go to the client. A CE that fails before its
       first token (transfer refused, CE dead): mark it down, try another CE; the PE still
       holds the handoff. All CEs failed, or one failed after tokens: PdFailed with the
       tokens sent so far, and the caller continues on a unified engine from there
       (`resume_request`: the same seed and position, so the client's stream goes on).
    3. the last chunk's usage names the PE, the CE and the bytes handed off.

`PdRoutes` owns the two routers (engine tables and affinity maps of PEs and CEs);
only the gateway core's event loop touches them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from kvmesh.errors import Unavailable
from kvmesh.proto import engine_pb2
from kvmesh.services.gateway.config import GatewayConfig, split_addresses
from kvmesh.services.gateway.model import Chunk, EngineFailure, HandoffInfo
from kvmesh.services.gateway.router import Router

log = logging.getLogger("kvmesh.gateway")


class PdFailed(Unavailable):
    """Disaggregation could not finish the request; `sent` tokens already went out."""

    def __init__(self, message: str, sent: int):
        super().__init__(message)
        self.sent = sent


class PdRoutes:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.prefill = Router(split_addresses(cfg.prefill_engines), cfg.affinity_entries,
                              cfg.max_imbalance)
        self.decode = Router(split_addresses(cfg.decode_engines), cfg.affinity_entries,
                             cfg.max_imbalance)

    def update_from_directory(self, engines, now: float) -> None:
        """Engine ids and loads of the configured PEs and CEs (no others join)."""
        engines = list(engines)
        for router in (self.prefill, self.decode):
            router.update_from_directory([e for e in engines if e.address in router.engines], now)

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> PdRoutes | None:
        return cls(cfg) if cfg.prefill_engines and cfg.decode_engines else None


async def serve_pd(greq, msg: engine_pb2.GenerateRequest, keys, holders) -> AsyncIterator[Chunk]:
    """The chunks of one disaggregated request (greq: the GatewayRequest, for its core,
    deadline and bookkeeping). Raises PdFailed when the caller must take over."""
    core = greq.core
    routes: PdRoutes = core.pd
    pe_msg = engine_pb2.GenerateRequest()
    pe_msg.CopyFrom(msg)
    pe_msg.handoff = True
    pe, first, info = None, None, None
    tried: list[str] = []
    while first is None and len(tried) < core.cfg.max_attempts:
        choice = routes.prefill.pick(core.clock(), keys, holders, exclude=tried)
        if choice is None:
            break
        pe = choice.engine
        tried.append(pe.address)
        greq.engine_id, greq.route = pe.engine_id, "pd-prefill"
        try:
            first, info = await _prefill(core, pe, pe_msg, greq)
        except EngineFailure as exc:
            routes.prefill.mark_down(pe.address, core.clock() + core.cfg.down_s)
            log.warning("request %s: prefill engine %s failed (%s)", msg.request_id, pe.engine_id, exc)
    if first is None or pe is None:
        raise PdFailed("no prefill engine could prefill the request", 0)
    routes.prefill.mark_up(pe.address)
    routes.prefill.remember(keys, pe.address)
    greq.prefill_engine = pe.engine_id
    if info is None:                 # finished on the PE (an end token, or max_tokens = 1)
        yield first._replace(usage=first.usage._replace(prefill_engine=pe.engine_id))
        return
    yield Chunk(first.token_ids, first.text, logprobs=first.logprobs)
    async for chunk in _decode(greq, pe.address, pe.engine_id, msg.request_id, info, keys,
                               first.usage):
        yield chunk


async def _prefill(core, pe, pe_msg, greq) -> tuple[Chunk, HandoffInfo | None]:
    """The PE's answer: (its last chunk, the handoff) or (a finished chunk, None)."""
    pe.in_flight += 1
    try:
        await core.check_identity(pe)
        tokens, text, logprobs = [], "", ()
        async with contextlib.aclosing(core.pool.stream(pe.address, pe_msg, greq._remaining())) as chunks:
            async for chunk in chunks:
                tokens += chunk.token_ids
                text += chunk.text
                logprobs += chunk.logprobs
                if chunk.finish is not None:
                    last = Chunk(tokens, text, chunk.finish, chunk.usage, logprobs=logprobs)
                    return last, chunk.handoff if chunk.finish == "handoff" else None
        raise EngineFailure("prefill stream ended without a finish reason")
    finally:
        pe.in_flight -= 1


async def _decode(greq, pe_address: str, pe_id: str, request_id: str, info: HandoffInfo,
                  keys, pe_usage) -> AsyncIterator[Chunk]:
    core = greq.core
    routes: PdRoutes = core.pd
    src = engine_pb2.HandoffSource(address=pe_address, request_id=request_id,
                                   total_bytes=info.total_bytes, sha256=info.sha256,
                                   block_hashes=info.block_hashes)
    ce_msg = engine_pb2.GenerateRequest(handoff_from=src)
    tried: list[str] = []
    last: Exception | None = None
    while len(tried) < core.cfg.max_attempts:
        choice = routes.decode.pick(core.clock(), keys, None, exclude=tried)
        if choice is None:
            break
        ce = choice.engine
        tried.append(ce.address)
        greq.decode_engine = greq.engine_id = ce.engine_id
        greq.route = "pd"
        ce.in_flight += 1
        sent = 0
        try:
            await core.check_identity(ce)
            async with contextlib.aclosing(core.pool.stream(ce.address, ce_msg, greq._remaining())) as chunks:
                async for chunk in chunks:
                    sent += len(chunk.token_ids)
                    if chunk.usage is not None:
                        moved = chunk.handoff.total_bytes if chunk.handoff else info.total_bytes
                        # the prompt's cache hits happened on the PE
                        chunk = chunk._replace(usage=chunk.usage._replace(
                            cached_tokens=pe_usage.cached_tokens,
                            replayed_tokens=pe_usage.replayed_tokens,
                            prefill_engine=pe_id, decode_engine=ce.engine_id,
                            handoff_bytes=moved))
                    yield chunk
        except EngineFailure as exc:
            routes.decode.mark_down(ce.address, core.clock() + core.cfg.down_s)
            last = exc
            if sent:
                raise PdFailed(f"decode engine {ce.engine_id} failed after {sent} tokens: {exc}",
                               sent) from None
            log.warning("request %s: decode engine %s failed before its first token (%s); "
                        "trying another", request_id, ce.engine_id, exc)
            core.metrics.retries.inc()
            continue
        finally:
            ce.in_flight -= 1
        routes.decode.mark_up(ce.address)
        routes.decode.remember(keys, ce.address)
        return
    raise PdFailed(f"no decode engine could continue the request: {last}", 0)
