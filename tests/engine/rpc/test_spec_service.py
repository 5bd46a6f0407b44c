"""Speculative decoding over a real gRPC socket: the per-request `speculative` field, usage
(drafted / accepted tokens), GetStats counters, and bad settings -> INVALID_ARGUMENT naming
the field (the engine keeps serving). Conversion through the gateway's request path."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.engines import engine_request
from kvmesh.services.gateway.model import GenRequest
from kvmesh.services.gateway.validate import check_sampling
from tests.engine.rpc.test_service import EngineHarness

PROMPT = [7, 8, 9, 10, 11] * 8


@pytest.fixture(scope="module")
def h():
    harness = EngineHarness(num_slots=4, num_blocks=256, speculative="ngram:4")
    yield harness
    harness.close()


def test_speculative_request_equals_off_and_reports_usage(h):
    spec = h.run(h.client.complete(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True))
    off = h.run(h.client.complete(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True,
                                  speculative="off"))
    assert spec[0] == off[0] and len(spec[0]) == 24
    usage = spec[2].usage
    assert usage.generated_tokens == 24 and usage.drafted_tokens > 0
    assert 0 <= usage.accepted_tokens <= usage.drafted_tokens
    assert off[2].usage.drafted_tokens == 0
    stats = h.run(h.client.stats())
    assert stats["spec_drafted_tokens"] >= usage.drafted_tokens
    assert stats["spec_accepted_tokens"] >= usage.accepted_tokens
    assert "spec_mean_accepted" in stats and "spec_acceptance_pos1" in stats


@pytest.mark.parametrize("bad,message", [("ngram:5", "not allowed on this engine"),
                                         ("mtp:2", "not allowed on this engine"),
                                         ("eagle:2", "unknown method"),
                                         ("ngram:0", "needs a draft count")])
def test_bad_speculative_is_invalid_argument(h, bad, message):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        h.run(h.client.complete([1, 2, 3], max_tokens=2, speculative=bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculative" in info.value.details() and message in info.value.details()
    ids, _, _ = h.run(h.client.complete([1, 2, 3], max_tokens=2, temperature=0.0))
    assert len(ids) == 2


def test_gateway_checks_the_syntax_and_forwards_the_field():
    cfg = GatewayConfig()
    req = GenRequest("r", "hi", None, speculative="ngram:2")
    check_sampling(req, cfg)
    assert engine_request(req).sampling.speculative == "ngram:2"
    assert not engine_request(GenRequest("r", "hi", None)).sampling.HasField("speculative")
    with pytest.raises(InvalidArgument, match="sampling.speculative: unknown method"):
        check_sampling(GenRequest("r", "hi", None, speculative="fast:2"), cfg)
