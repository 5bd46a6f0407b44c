"""kvmesh/generation.py: the one place the class and finish names meet the common.v1 enums."""

from __future__ import annotations

import pytest

from kvmesh import generation as g
from kvmesh.errors import InvalidArgument
from kvmesh.proto import common_pb2, engine_pb2, gateway_pb2


def test_traffic_class_names_round_trip_every_enum_value():
    for name, value in (("", 0), ("agent", 1), ("chatbot", 2)):
        assert g.traffic_class_to_proto(name) == value
        assert g.traffic_class_name(value) == name
    assert set(common_pb2.TrafficClass.values()) == {0, 1, 2}


def test_unknown_traffic_class_is_named_in_the_error():
    assert g.traffic_class_name(7) == "TrafficClass(7)"
    with pytest.raises(InvalidArgument, match=r"not 'TrafficClass\(7\)'"):
        g.check_traffic_class(g.traffic_class_name(7))
    with pytest.raises(InvalidArgument, match="not 'batch'"):
        g.traffic_class_to_proto("batch")


def test_finish_reasons_round_trip():
    assert [g.finish_to_proto(n) for n in (None, "length", "stop", "aborted")] == [0, 1, 2, 3]
    assert [g.finish_name(v) for v in (0, 1, 2, 3, 9)] == [None, "length", "stop", "aborted", None]


@pytest.mark.parametrize("request_type", [engine_pb2.GenerateRequest, gateway_pb2.GenerateRequest])
def test_set_sampling_sets_only_given_fields_on_both_requests(request_type):
    req = g.set_sampling(request_type(), max_tokens=5, top_k=3, seed=0)
    assert req.max_tokens == 5 and req.sampling.top_k == 3 and req.sampling.seed == 0
    assert not req.sampling.HasField("temperature") and not req.sampling.HasField("top_p")
    assert not g.set_sampling(request_type()).HasField("max_tokens")


def test_default_max_tokens_is_the_engines_default():
    from kvmesh.services.engine.core.sampling import SamplingParams
    from kvmesh.services.engine.rpc.service import params_from_proto

    assert SamplingParams().max_tokens == g.DEFAULT_MAX_TOKENS == 64
    assert params_from_proto(engine_pb2.GenerateRequest()).max_tokens == 64


def test_sampling_controls_survive_every_hop():
    """gateway proto -> GenRequest -> engine proto -> SamplingParams -> the PD handoff's
    request -> SamplingParams: min_p and the penalties arrive as given, unset ones as the
    engine's defaults."""
    from kvmesh.services.engine.core.sampling import SamplingParams
    from kvmesh.services.engine.rpc.handoff_transfer import params_to_request
    from kvmesh.services.engine.rpc.service import params_from_proto
    from kvmesh.services.gateway.engines import engine_request
    from kvmesh.services.gateway.service import request_from_proto

    given = {"min_p": 0.25, "presence_penalty": -0.5, "repetition_penalty": 1.25, "logprobs": 4}
    msg = g.set_sampling(gateway_pb2.GenerateRequest(prompt="x"), **given)
    req = request_from_proto(msg, 1 << 20)
    assert req.controls() == {**given, "frequency_penalty": None}
    params = params_from_proto(engine_request(req))
    assert (params.min_p, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, params.logprobs) == (0.25, -0.5, 0.0, 1.25, 4)
    assert params_from_proto(params_to_request(params, "", "")) == params
    assert params_from_proto(engine_pb2.GenerateRequest()) == SamplingParams()
    with pytest.raises(TypeError, match="min_q"):
        g.set_sampling(engine_pb2.GenerateRequest(), min_q=1.0)
