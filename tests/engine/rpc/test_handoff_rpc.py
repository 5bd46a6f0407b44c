"""Handoff over real gRPC sockets: a prefill engine (ring 396) hands a request to a decode
engine (ring 134) through FetchHandoff; the tokens equal a unified engine's (the shipped
model in float64). A handoff
named wrongly (size, digest) or missing is refused with UNAVAILABLE (the gateway's cue to
try elsewhere), never INTERNAL, and nothing is installed."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.proto import engine_pb2, engine_pb2_grpc
from kvmesh.rpc import Server
from kvmesh.services.engine.core.async_engine import AsyncEngine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.rpc.client import EngineClient, generate_request
from kvmesh.services.engine.rpc.server import SERVICE_NAME
from kvmesh.services.engine.rpc.service import EngineServicer
from tests.engine.engines import random_prompt, run_to_completion, serve_core
from tests.loop import LoopThread

FLAGS = ("--dtype", "float64", "--truncation", "compact", "--keep-tokens", "134",
         "--num-blocks", "64", "--num-slots", "4", "--long-prefill-chunk", "33")


def make_engine(*flags: str):
    return serve_core(*FLAGS, *flags)


class Pair(LoopThread):
    """A PE and a CE server on one loop; a unified core for reference."""

    def __init__(self):
        super().__init__()
        self.pe_core = make_engine("--extra-state", "--role", "prefill",
                                   "--speculative", "ngram:4")  # accepts any mode a request asks for
        self.ce_core = make_engine("--role", "decode")
        self.unified = make_engine()
        # a decode engine whose own default speculates, and a unified one that may
        self.ce_spec_core = make_engine("--role", "decode", "--speculative", "ngram:4")
        self.unified_spec = make_engine("--speculative", "ngram:4")
        self.engines = [AsyncEngine(c) for c in (self.pe_core, self.ce_core, self.ce_spec_core)]
        self.servers = [self.run(self._server(e)) for e in self.engines]
        self.pe, self.ce, self.ce_spec = (f"127.0.0.1:{s.port}" for s in self.servers)
        self.pe_client = self.make(EngineClient, self.pe)
        self.ce_client = self.make(EngineClient, self.ce)
        self.ce_spec_client = self.make(EngineClient, self.ce_spec)

    async def _server(self, engine):
        server = Server("127.0.0.1:0", [SERVICE_NAME])
        engine_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(engine), server.server)
        await server.start()
        return server

    def close(self):
        for c in (self.pe_client, self.ce_client, self.ce_spec_client):
            self.run(c.close())
        for s in self.servers:
            self.run(s.stop(0.1))
        for e in self.engines:
            e.shutdown()
        super().close()


@pytest.fixture(scope="module")
def pair():
    p = Pair()
    yield p
    p.close()


async def _prefill(client, prompt, rid, **kw):
    req = generate_request(prompt, request_id=rid, **kw)
    req.handoff = True
    msgs = [m async for m in client.stub.Generate(req, timeout=60)]
    return msgs


async def _decode(client, src):
    req = engine_pb2.GenerateRequest(handoff_from=src)
    return [m async for m in client.stub.Generate(req, timeout=60)]


def _source(pair, rid, info, **change):
    src = engine_pb2.HandoffSource(address=pair.pe, request_id=rid, total_bytes=info.total_bytes,
                                   sha256=info.sha256, block_hashes=info.block_hashes)
    for k, v in change.items():
        if k == "block_hashes":
            del src.block_hashes[:]
            src.block_hashes.extend(v)
        else:
            setattr(src, k, v)
    return src


@pytest.mark.parametrize("n, sampling", [(300, dict(temperature=0.0)),
                                         (397, dict(temperature=1.0, top_k=40, seed=77))])
def test_tokens_over_grpc_equal_a_unified_engine(pair, n, sampling):
    prompt, rid = random_prompt(n, n), f"grpc-{n}"
    first = pair.run(_prefill(pair.pe_client, prompt, rid, max_tokens=6, **sampling))
    last = first[-1]
    assert last.finish_reason == 4 and len(last.token_ids) == 1       # FINISH_REASON_HANDOFF
    info = last.handoff
    assert info.state_bytes == pair.ce_core.handoff_state_bytes and info.blocks == -(-n // 128)
    rest = pair.run(_decode(pair.ce_client, _source(pair, rid, info)))
    tokens = [t for m in first + rest for t in m.token_ids]
    assert rest[-1].usage.generated_tokens == 6 and rest[-1].usage.prompt_tokens == n

    params = SamplingParams(max_tokens=6, **sampling)
    want = pair.unified.add_request(prompt, params)
    run_to_completion(pair.unified)
    assert tokens == want.output
    stats = pair.run(pair.ce_client.stats())
    assert stats["handoffs_in"] >= 1 and stats["handoff_in_bytes"] >= info.total_bytes


@pytest.mark.parametrize("ce_default, mode", [("off", "off"), ("ngram:4", "off"),
                                              ("ngram:4", "ngram:2"), ("ngram:4", "ngram:4")])
def test_the_decode_engine_samples_with_the_requests_speculative_mode(pair, ce_default, mode):
    """Seeded sampling over PD equals the unified engine's stream under the request's
    `speculative`, whatever the decode engine's own default (before: the handoff dropped
    the mode and an ngram:4 decode engine speculated an `off` request, diverging from
    output index 3)."""
    # a prompt of its own per case: a second run of one prompt would hit the PE's cache
    # through a bounded replay, which is approximate (and so would differ, not the handoff)
    rid = f"spec-{ce_default}-{mode}"
    prompt = random_prompt(300, len(rid) + ord(mode[-1])) + random_prompt(40, 12) * 4
    sampling = dict(temperature=0.8, seed=123, max_tokens=24, speculative=mode)
    first = pair.run(_prefill(pair.pe_client, prompt, rid, **sampling))
    client = pair.ce_client if ce_default == "off" else pair.ce_spec_client
    rest = pair.run(_decode(client, _source(pair, rid, first[-1].handoff)))
    tokens = [t for m in first + rest for t in m.token_ids]

    unified = pair.unified if mode == "off" else pair.unified_spec
    want = unified.add_request(prompt, SamplingParams(**sampling))
    run_to_completion(unified)
    assert len(want.output) == 24 and tokens == want.output
    if mode != "off":   # the request's mode ran on the decode engine: drafts were verified
        assert rest[-1].usage.drafted_tokens > 0


def test_damaged_or_missing_handoffs_are_unavailable_not_internal(pair):
    rid = "bad"
    first = pair.run(_prefill(pair.pe_client, random_prompt(260, 5), rid, max_tokens=4,
                              temperature=0.0, ignore_eos=True))
    info = first[-1].handoff
    before = pair.run(pair.ce_client.stats())
    cases = [dict(sha256="0" * 64),                       # damaged in transit / wrong bytes
             dict(total_bytes=info.total_bytes - 1),      # truncated
             dict(block_hashes=[b"x" * 32] * len(info.block_hashes)),   # not the PE's blocks
             dict(total_bytes=10**12),                    # over the engine's bound
             dict(request_id="never-handed-off"),         # not held: NOT_FOUND at the PE
             dict(address="127.0.0.1:1")]                 # PE gone
    for change in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            pair.run(_decode(pair.ce_client, _source(pair, rid, info, **change)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (change, err.value.details())
    after = pair.run(pair.ce_client.stats())
    assert after["handoffs_in"] == before["handoffs_in"]
    assert after["handoff_refused"] == before["handoff_refused"] + len(cases)
    assert after["slots_in_use"] == 0
    # the intact handoff is still held by the PE and goes through afterwards
    rest = pair.run(_decode(pair.ce_client, _source(pair, rid, info)))
    assert rest[-1].usage.generated_tokens == 4


def test_blocks_the_decode_engine_holds_are_not_sent(pair):
    """A second prompt over the same 2 complete blocks: the CE holds them from the first
    handoff, asks the PE to skip them, and still decodes a unified engine's tokens."""
    base = random_prompt(400, 77)
    sent = []
    for rid, prompt in (("share-1", base[:300]), ("share-2", base[:256] + random_prompt(80, 78))):
        first = pair.run(_prefill(pair.pe_client, prompt, rid, max_tokens=4, temperature=0.0))
        info = first[-1].handoff
        rest = pair.run(_decode(pair.ce_client, _source(pair, rid, info)))
        sent.append((info.total_bytes, rest[-1].handoff.total_bytes))
        want = pair.unified.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4))
        run_to_completion(pair.unified)
        assert [t for m in first + rest for t in m.token_ids] == want.output
    block = pair.ce_core.block_bytes
    assert sent[0][1] == sent[0][0]                   # nothing held yet: everything moved
    assert sent[1][1] == sent[1][0] - 2 * block       # the 2 shared blocks stayed home


def test_fetch_handoff_of_an_unknown_request_is_not_found(pair):
    async def fetch():
        return [m async for m in pair.pe_client.stub.FetchHandoff(
            engine_pb2.FetchHandoffRequest(request_id="nope"), timeout=10)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        pair.run(fetch())
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_decode_role_refuses_a_long_ring():
    with pytest.raises(ValueError, match="role decode"):
        make_engine("--extra-state", "--role", "decode")
    with pytest.raises(ValueError, match="role prefill needs extra-state"):
        make_engine("--role", "prefill", "--no-extra-state")
