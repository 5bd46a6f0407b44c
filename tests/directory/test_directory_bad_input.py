"""Bad input -> INVALID_ARGUMENT / NOT_FOUND naming the culprit; never INTERNAL."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.proto import directory_pb2 as pb
from kvmesh.proto import directory_pb2_grpc as pb_grpc
from kvmesh.services.directory.config import DirectoryConfig

OK_KEY = "ab" * 32
BAD_KEYS = [
    ("uppercase", "AB" * 32),
    ("too short", "a" * 31),
    ("too long", "a" * 129),
    ("not hex", "g" * 64),
    ("empty", ""),
    ("spaces", " " + "a" * 63),
    ("colon (would forge Redis key names)", "a" * 32 + ":lease:x"),
    ("non-ascii digits", "٣" * 40),
]


@pytest.fixture
def stub(directory):
    with grpc.insecure_channel(directory.address) as ch:
        yield pb_grpc.DirectoryServiceStub(ch)


def code_of(call, request) -> tuple[grpc.StatusCode, str]:
    try:
        call(request, timeout=5)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def register(stub, engine_id="e1"):
    stub.Heartbeat(pb.HeartbeatRequest(engine_id=engine_id, address="127.0.0.1:1"), timeout=5)


@pytest.mark.parametrize("why,bad", BAD_KEYS, ids=[w for w, _ in BAD_KEYS])
def test_malformed_key_is_invalid_argument_naming_it(stub, why, bad):
    register(stub)
    lookup = pb.LookupRequest(keys=[OK_KEY, bad])
    publish = pb.PublishRequest(engine_id="e1", entries=[pb.SnapshotEntry(
        key=bad, position=128, size_bytes=1)])
    withdraw = pb.WithdrawRequest(engine_id="e1", keys=[bad])
    for call, req, field in ((stub.Lookup, lookup, "keys[1]"),
                             (stub.Publish, publish, "entries[0].key"),
                             (stub.Withdraw, withdraw, "keys[0]")):
        code, details = code_of(call, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith(f"{field}: ") and "not a snapshot key" in details
        assert repr(bad)[:20] in details


def test_oversized_batches_are_invalid_argument(make_directory):
    h = make_directory(max_batch=16)
    with grpc.insecure_channel(h.address) as ch:
        stub = pb_grpc.DirectoryServiceStub(ch)
        register(stub)
        keys = [f"{i:064x}" for i in range(17)]
        entries = [pb.SnapshotEntry(key=k, position=128, size_bytes=1) for k in keys]
        for call, req in ((stub.Lookup, pb.LookupRequest(keys=keys)),
                          (stub.Publish, pb.PublishRequest(engine_id="e1", entries=entries)),
                          (stub.Withdraw, pb.WithdrawRequest(engine_id="e1", keys=keys))):
            code, details = code_of(call, req)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "17 items is over the batch limit of 16" in details
        assert code_of(stub.Lookup, pb.LookupRequest(keys=keys[:16]))[0] == grpc.StatusCode.OK
    assert DirectoryConfig().max_batch == 4096


def test_unknown_engine_is_not_found(stub):
    entry = pb.SnapshotEntry(key=OK_KEY, position=128, size_bytes=1)
    for call, req in ((stub.Publish, pb.PublishRequest(engine_id="ghost", entries=[entry])),
                      (stub.Withdraw, pb.WithdrawRequest(engine_id="ghost", keys=[OK_KEY]))):
        code, details = code_of(call, req)
        assert code == grpc.StatusCode.NOT_FOUND
        assert details == "engine ghost is not registered; send Heartbeat first"


BAD_FIELDS = [
    ("engine_id empty", lambda s: (s.Heartbeat, pb.HeartbeatRequest(
        engine_id="", address="h:1")), "engine_id"),
    ("engine_id with colon", lambda s: (s.Heartbeat, pb.HeartbeatRequest(
        engine_id="a:b", address="h:1")), "engine_id"),
    ("engine_id too long", lambda s: (s.Heartbeat, pb.HeartbeatRequest(
        engine_id="e" * 65, address="h:1")), "engine_id"),
    ("address without port", lambda s: (s.Heartbeat, pb.HeartbeatRequest(
        engine_id="e", address="host")), "address"),
    ("address port 0", lambda s: (s.Heartbeat, pb.HeartbeatRequest(
        engine_id="e", address="host:0")), "address"),
    ("address port too big", lambda s: (s.Heartbeat, pb.HeartbeatRequest(
        engine_id="e", address="host:65536")), "address"),
    ("address bad ipv6", lambda s: (s.Heartbeat, pb.HeartbeatRequest(
        engine_id="e", address="[zz::1]:80")), "address"),
    ("address underscore host", lambda s: (s.Heartbeat, pb.HeartbeatRequest(
        engine_id="e", address="a_b:80")), "address"),
    ("position not aligned", lambda s: (s.Publish, pb.PublishRequest(engine_id="e1", entries=[
        pb.SnapshotEntry(key=OK_KEY, position=129, size_bytes=1)])), "entries[0].position"),
    ("position zero", lambda s: (s.Publish, pb.PublishRequest(engine_id="e1", entries=[
        pb.SnapshotEntry(key=OK_KEY, position=0, size_bytes=1)])), "entries[0].position"),
    ("size zero", lambda s: (s.Publish, pb.PublishRequest(engine_id="e1", entries=[
        pb.SnapshotEntry(key=OK_KEY, position=128, size_bytes=0)])), "entries[0].size_bytes"),
    ("ttl zero", lambda s: (s.Publish, pb.PublishRequest(engine_id="e1", entries=[
        pb.SnapshotEntry(key=OK_KEY, position=128, size_bytes=1, ttl_s=0)])), "entries[0].ttl_s"),
    ("ttl over max", lambda s: (s.Publish, pb.PublishRequest(engine_id="e1", entries=[
        pb.SnapshotEntry(key=OK_KEY, position=128, size_bytes=1, ttl_s=86401)])),
     "entries[0].ttl_s"),
]


@pytest.mark.parametrize("why,make,field", BAD_FIELDS, ids=[w for w, _, _ in BAD_FIELDS])
def test_bad_field_is_invalid_argument_naming_the_field(stub, why, make, field):
    register(stub)
    code, details = code_of(*make(stub))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field + ":")


def test_good_addresses_are_accepted(stub):
    for address in ("127.0.0.1:50051", "engine-3.svc.cluster.local:7000", "[::1]:80", "h:65535"):
        assert code_of(stub.Heartbeat, pb.HeartbeatRequest(engine_id="e", address=address))[0] \
            == grpc.StatusCode.OK, address


# --- fuzz: whatever the fields hold, the answer is never INTERNAL ------------------

text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=140)
hexkey = st.text(alphabet="0123456789abcdef", min_size=30, max_size=130)
keys = st.lists(st.one_of(hexkey, text), max_size=8)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
engine_ids = st.one_of(st.sampled_from(["e1", "fz", "ghost"]), text)
addresses = st.one_of(st.sampled_from(["127.0.0.1:1", "[::1]:9", "x:0"]), text)
entries = st.lists(st.builds(
    pb.SnapshotEntry, key=st.one_of(hexkey, text), position=u64, size_bytes=u64,
    ttl_s=st.one_of(st.none(), st.integers(0, 2**32 - 1))), max_size=5)
loads = st.builds(pb.EngineLoad, running_seqs=st.integers(0, 2**32 - 1),
                  free_blocks=st.integers(0, 2**32 - 1))
requests = st.one_of(
    st.tuples(st.just("Heartbeat"), st.builds(
        pb.HeartbeatRequest, engine_id=engine_ids, address=addresses, load=loads,
        restarted=st.booleans())),
    st.tuples(st.just("Publish"), st.builds(pb.PublishRequest, engine_id=engine_ids,
                                             entries=entries)),
    st.tuples(st.just("Lookup"), st.builds(pb.LookupRequest, keys=keys)),
    st.tuples(st.just("Withdraw"), st.builds(pb.WithdrawRequest, engine_id=engine_ids,
                                              keys=keys)),
    st.tuples(st.just("ListEngines"), st.just(pb.ListEnginesRequest())),
)
EXPECTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests)
def test_fuzzed_requests_never_get_internal(stub, req):
    method, message = req
    code, details = code_of(getattr(stub, method), message)
    assert code in EXPECTED, (method, code, details)
