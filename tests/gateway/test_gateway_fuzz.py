"""Malformed and extreme Generate requests against a running mesh.

Whatever arrives, the gateway answers with a deliberate status (never INTERNAL
or UNKNOWN), no service process dies, and a normal request works afterwards.
"""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.proto import gateway_pb2 as pb

I32 = st.integers(-(2**31), 2**31 - 1)
U32 = st.integers(0, 2**32 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=300)
# Valid max_tokens stay tiny so accepted requests finish in milliseconds.
MAX_TOKENS = st.one_of(st.none(), st.integers(-(2**31), 0), st.integers(1, 3),
                       st.integers(8193, 2**31 - 1))


@st.composite
def requests(draw):
    req = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), TEXT)),
        stop=draw(st.lists(st.text(max_size=8), max_size=20)),
        stop_token_ids=draw(st.lists(U32, max_size=20)),
        traffic_class=draw(st.integers(0, 9)),
        cache_salt=draw(st.one_of(st.just(""), TEXT)),
        ignore_eos=draw(st.booleans()),
    )
    if draw(st.booleans()):
        req.prompt = draw(TEXT)
    else:
        req.prompt_token_ids.ids.extend(draw(st.lists(
            st.one_of(st.integers(0, 259), U32), max_size=300)))
    max_tokens = draw(MAX_TOKENS)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    for name, strat in (("temperature", FLOATS), ("top_p", FLOATS), ("top_k", I32),
                        ("seed", st.integers(0, 2**64 - 1))):
        value = draw(st.one_of(st.none(), strat))
        if value is not None:
            setattr(req.sampling, name, value)
    return req


@st.composite
def valid_requests(draw):
    """Requests the gateway must accept: the fuzz covers both sides of validation. Fully
    random ones are rarely valid (a field out of range is likely), so a run of 200 could
    otherwise end with no accepted request at all."""
    req = pb.GenerateRequest(prompt=draw(st.text(st.characters(min_codepoint=32,
                                                               max_codepoint=126),
                                                 min_size=1, max_size=200)),
                             max_tokens=draw(st.integers(1, 3)),
                             ignore_eos=draw(st.booleans()))
    req.sampling.temperature = draw(st.floats(0, 2, width=32))
    return req


def test_fuzzed_requests_never_internal_and_nothing_crashes(gw, mesh):
    seen: dict[str, int] = {}

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(requests(), valid_requests()), st.booleans())
    def one(req, streaming):
        try:
            if streaming:
                list(gw.stub.GenerateStream(req, timeout=20))
            else:
                gw.stub.Generate(req, timeout=20)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                exc.details())
        seen[code] = seen.get(code, 0) + 1

    one()
    assert "INVALID_ARGUMENT" in seen and "OK" in seen, seen
    dead = [name for name in mesh.procs if not mesh.alive(name)]
    assert not dead, f"crashed: {dead}"
    assert gw.generate("still alive?", max_tokens=3, temperature=0.0).usage.generated_tokens >= 1
