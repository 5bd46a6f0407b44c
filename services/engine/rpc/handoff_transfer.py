"""Handoff transfer between engines (FetchHandoff): the prefill engine's serving stream and
the decode engine's checked fetch, modelled on the snapshot fetch (peers.py).

    gateway --Generate{handoff}--> PE: prefill, first token, last message HandoffInfo
    gateway --Generate{handoff_from: PE, id, total_bytes, sha256, block hashes}--> CE
        CE: which of those complete blocks its pool holds -> skip
        CE --FetchHandoff{id, skip}--> PE: header | data <= 1 MiB ... | sha256
        CE checks: size (header, the gateway's total less the skipped blocks, the bound),
        state size (this engine's slot), fingerprints, block hashes (the gateway's),
        block sizes, sha256 (of the stream; of the state: the gateway's);
        any failure -> Unavailable (the gateway tries another CE or a unified engine)
        CE: Engine.adopt -> decode; tokens stream to the gateway

The data is the rearranged slot state followed by the serialized blocks not skipped;
each block carries its own digest (block_store.py), checked before it is installed. A
skipped block that was evicted before the adoption makes it refused (Unavailable).
"""

from __future__ import annotations

import hashlib
import time

from kvmesh.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.generation import (
    SAMPLING_CONTROLS,
    set_sampling,
    traffic_class_name,
    traffic_class_to_proto,
)
from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import channel
from kvmesh.services.engine.cache.slot_handoff import SlotHandoff
from kvmesh.services.engine.core.handoff_store import Handoff
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.rpc.peers import FetchError, body_messages, read_transfer


def handoff_info(h: Handoff) -> engine_pb2.HandoffInfo:
    return engine_pb2.HandoffInfo(state_bytes=len(h.slot.state), total_bytes=h.nbytes,
                                  blocks=len(h.slot.blocks), block_hashes=h.slot.hashes,
                                  sha256=hashlib.sha256(h.slot.state).hexdigest())


def _sent_sizes(h: Handoff, skip: set[bytes]) -> list[int]:
    """Size of each block in the stream: 0 for a complete block the receiver holds."""
    hashes = h.slot.hashes
    return [0 if i < len(hashes) and hashes[i] in skip else len(b)
            for i, b in enumerate(h.slot.blocks)]


def params_to_request(p: SamplingParams, salt: str, traffic_class: str) -> engine_pb2.GenerateRequest:
    """The sampling and stop fields of a GenerateRequest (the inverse of params_from_proto).
    `speculative` travels too: the decode engine must verify with the request's mode, not
    its own default, or a seeded sampled stream differs from the unified engine's (the
    draws depend on how many tokens each step verifies). "" (the request left it to the
    engine) stays unset."""
    req = engine_pb2.GenerateRequest(stop_token_ids=p.stop_token_ids, stop=p.stop,
                                     ignore_eos=p.ignore_eos, cache_salt=salt,
                                     traffic_class=traffic_class_to_proto(traffic_class))
    return set_sampling(req, p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed,
                        p.speculative or None,
                        **{name: getattr(p, name) for name in SAMPLING_CONTROLS})


def handoff_messages(h: Handoff | None, request_id: str, skip=()):
    """The response stream for one handoff, without the blocks in `skip` (NotFound when it
    is not held)."""
    if h is None:
        raise NotFound(f"no handoff of request {request_id!r} is held by this engine")
    s = h.slot
    sizes = _sent_sizes(h, set(skip))
    data = b"".join((s.state, *(b for b, n in zip(s.blocks, sizes, strict=True) if n)))
    header = engine_pb2.HandoffHeader(
        request_id=h.request_id, prompt_token_ids=h.prompt, output_token_ids=h.output,
        request=params_to_request(h.params, h.salt, h.traffic_class), seed=h.seed,
        num_computed=s.num_computed, enc_lo=s.enc_lo, dec_lo=s.dec_lo, cmp_from=s.cmp_from,
        block_hashes=s.hashes, block_sizes=sizes,
        state_bytes=len(s.state), total_bytes=len(data), layout_fingerprint=h.layout_fp,
        model_fingerprint=h.model_fp)
    yield engine_pb2.FetchHandoffResponse(header=header)
    yield from body_messages(data, engine_pb2.FetchHandoffResponse)


def check_source(src) -> None:
    if not src.address or not src.request_id:
        raise InvalidArgument("handoff_from needs address and request_id")


async def fetch_handoff(src, params_from_proto, timeout_s: float, expect_layout: str,
                        expect_model: str, expect_state: int, max_bytes: int,
                        skip: list[bytes], block_bytes: int) -> tuple[Handoff, float]:
    """Fetch and verify the handoff `src` (a HandoffSource) names, without the blocks in
    `skip` (a subset of src.block_hashes, each `block_bytes` long); returns (handoff,
    seconds). Unavailable on any problem: the caller refuses the request, nothing installed."""
    t0 = time.perf_counter()
    want = src.total_bytes - len(skip) * block_bytes
    if src.total_bytes > max_bytes:
        raise Unavailable(f"handoff of {want} B exceeds this engine's bound of {max_bytes} B")
    async with channel(src.address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        try:   # bounded: reads no more than the announced bytes
            first, data, digest = await read_transfer(stub.FetchHandoff(
                engine_pb2.FetchHandoffRequest(request_id=src.request_id, skip=skip),
                timeout=timeout_s), limit=want)
        except FetchError as exc:
            raise Unavailable(f"handoff fetch from {src.address}: {exc}") from None
    header = first.header
    problems = []
    if header.layout_fingerprint != expect_layout or header.model_fingerprint != expect_model:
        problems.append("layout or model fingerprint differs")
    if not len(data) == header.total_bytes == want:
        problems.append(f"size {len(data)} B, header {header.total_bytes} B, expected {want} B")
    if header.state_bytes != expect_state or sum(header.block_sizes) != len(data) - expect_state:
        problems.append(f"state {header.state_bytes} B (this engine's slot: {expect_state} B) "
                        f"or block sizes do not add up")
    if list(header.block_hashes) != list(src.block_hashes):
        problems.append("block hashes differ from the handoff's")
    skipped = {i for i, x in enumerate(header.block_hashes) if x in set(skip)}
    if {i for i, n in enumerate(header.block_sizes) if n == 0} != skipped:
        problems.append("skipped blocks differ from the ones asked for")
    if hashlib.sha256(data).hexdigest() != digest or \
            hashlib.sha256(data[: header.state_bytes]).hexdigest() != src.sha256:
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
