"""Handoff transfer between engines (FetchHandoff): the prefill engine's serving stream and
the decode engine's checked fetch, modelled on the snapshot fetch (peers.py).

    gateway --Generate{handoff}--> PE: prefill, first token, last message HandoffInfo
    gateway --Generate{handoff_from: PE, id, total_bytes, sha256}--> CE
        CE --FetchHandoff{id}--> PE: header | data <= 1 MiB ... | sha256
        CE checks: total size (header, gateway's HandoffInfo, the bound), state size
        (this engine's slot), fingerprints, block sizes, sha256 (stream and gateway's);
        any failure -> Unavailable (the gateway tries another CE or a unified engine)
        CE: EngineCore.adopt -> decode; tokens stream to the gateway

The data is the rearranged slot state followed by the serialized blocks; each block
also carries its own digest (block_store.py), checked again when it is installed.
"""

from __future__ import annotations

import hashlib
import time

import grpc

from kvmesh.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.generation import set_sampling, traffic_class_name, traffic_class_to_proto
from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import channel
from services.engine.cache.handoff import SlotHandoff
from services.engine.core.handoff import Handoff
from services.engine.core.sampling import SamplingParams

CHUNK = 1 << 20


def handoff_data(h: Handoff) -> bytes:
    return b"".join((h.slot.state, *h.slot.blocks))


def handoff_info(h: Handoff) -> engine_pb2.HandoffInfo:
    return engine_pb2.HandoffInfo(state_bytes=len(h.slot.state), total_bytes=h.nbytes,
                                  blocks=len(h.slot.blocks),
                                  sha256=hashlib.sha256(handoff_data(h)).hexdigest())


def params_to_request(p: SamplingParams, salt: str, traffic_class: str) -> engine_pb2.GenerateRequest:
    """The sampling and stop fields of a GenerateRequest (the inverse of params_from_proto)."""
    req = engine_pb2.GenerateRequest(stop_token_ids=p.stop_token_ids, stop=p.stop,
                                     ignore_eos=p.ignore_eos, cache_salt=salt,
                                     traffic_class=traffic_class_to_proto(traffic_class))
    return set_sampling(req, p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed)


def handoff_messages(h: Handoff | None, request_id: str):
    """The response stream for one handoff (NotFound when it is not held)."""
    if h is None:
        raise NotFound(f"no handoff of request {request_id!r} is held by this engine")
    s = h.slot
    header = engine_pb2.HandoffHeader(
        request_id=h.request_id, prompt_token_ids=h.prompt, output_token_ids=h.output,
        request=params_to_request(h.params, h.salt, h.traffic_class), seed=h.seed,
        num_computed=s.num_computed, enc_lo=s.enc_lo, dec_lo=s.dec_lo, cmp_from=s.cmp_from,
        block_hashes=s.hashes, block_sizes=[len(b) for b in s.blocks],
        state_bytes=len(s.state), total_bytes=h.nbytes, layout_fingerprint=h.layout_fp,
        model_fingerprint=h.model_fp)
    yield engine_pb2.FetchHandoffResponse(header=header)
    data = handoff_data(h)
    for off in range(0, len(data), CHUNK):
        yield engine_pb2.FetchHandoffResponse(data=data[off : off + CHUNK])
    yield engine_pb2.FetchHandoffResponse(sha256=hashlib.sha256(data).hexdigest())


def check_source(src) -> None:
    if not src.address or not src.request_id:
        raise InvalidArgument("handoff_from needs address and request_id")


async def fetch_handoff(src, params_from_proto, timeout_s: float, expect_layout: str,
                        expect_model: str, expect_state: int, max_bytes: int
                        ) -> tuple[Handoff, float]:
    """Fetch and verify the handoff `src` (a HandoffSource) names; returns (handoff,
    seconds). Unavailable on any problem: the caller refuses the request, nothing installed."""
    t0 = time.perf_counter()
    want = src.total_bytes
    if want > max_bytes:
        raise Unavailable(f"handoff of {want} B exceeds this engine's bound of {max_bytes} B")
    header, parts, got, digest = None, [], 0, ""
    async with channel(src.address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        try:
            async for msg in stub.FetchHandoff(
                    engine_pb2.FetchHandoffRequest(request_id=src.request_id), timeout=timeout_s):
                if header is None:
                    header = msg.header
                elif msg.sha256:
                    digest = msg.sha256
                else:
                    got += len(msg.data)
                    if got > want:          # bounded: stop reading what was not announced
                        raise Unavailable(f"handoff from {src.address} sends more than {want} B")
                    parts.append(msg.data)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"handoff fetch from {src.address}: {exc.code().name} "
                              f"{exc.details()}") from None
    if header is None:
        raise Unavailable(f"handoff fetch from {src.address}: empty stream")
    data = b"".join(parts)
    problems = []
    if header.layout_fingerprint != expect_layout or header.model_fingerprint != expect_model:
        problems.append("layout or model fingerprint differs")
    if not len(data) == header.total_bytes == want:
        problems.append(f"size {len(data)} B, header {header.total_bytes} B, expected {want} B")
    if header.state_bytes != expect_state or sum(header.block_sizes) != len(data) - expect_state:
        problems.append(f"state {header.state_bytes} B (this engine's slot: {expect_state} B) "
                        f"or block sizes do not add up")
    sha = hashlib.sha256(data).hexdigest()
    if sha != digest or sha != src.sha256:
        problems.append("sha256 mismatch")
    if problems:
        raise Unavailable(f"handoff {src.request_id!r} from {src.address} refused: "
                          + "; ".join(problems))
    return _handoff(header, data, params_from_proto), time.perf_counter() - t0


def _handoff(header, data: bytes, params_from_proto) -> Handoff:
    blocks, off = [], header.state_bytes
    for n in header.block_sizes:
        blocks.append(data[off : off + n])
        off += n
    slot = SlotHandoff(header.num_computed, header.enc_lo, header.dec_lo, header.cmp_from,
                       tuple(header.block_hashes), tuple(blocks), data[: header.state_bytes])
    req = header.request
    return Handoff(header.request_id, tuple(header.prompt_token_ids),
                   tuple(header.output_token_ids), params_from_proto(req), header.seed,
                   req.cache_salt, traffic_class_name(req.traffic_class), header.layout_fingerprint,
                   header.model_fingerprint, slot)
