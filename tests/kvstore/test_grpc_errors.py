"""Bad input gets INVALID_ARGUMENT naming the problem; S3 down gets UNAVAILABLE
on admin calls and clean misses on the data path. Nothing crashes the service."""

import asyncio

import grpc
import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.launch.backing.proc import free_port
from kvmesh.proto import kvstore_pb2 as pb
from kvmesh.services.kvstore.config import KvstoreConfig, ShardLocation
from tests.kvstore.conftest import call, hexkey

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def code_of(address, fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(address, fn)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("key", [
    "", "abc", "A" * 64, "g" * 64, "a" * 31, "a" * 129, "ab" * 31 + "z!", "../" + "a" * 64,
])
def test_malformed_key_is_invalid_argument_naming_it(kv, key):
    calls = {"get": lambda c: c.get([hexkey(1), key]), "put": lambda c: c.put([(key, b"x")]),
             "lookup": lambda c: c.lookup([key]), "delete": lambda c: c.delete([key])}
    for name, fn in calls.items():
        code, details = code_of(kv.address, fn)
        assert code == INVALID and repr(key)[1:-1][:40] in details, (name, code, details)


def test_unknown_traffic_class_is_invalid_argument(kv):
    # traffic_class is a common.v1 TrafficClass: a number outside the enum still reaches
    # the server (proto3 enums are open) and is named; an unknown name never leaves the client.
    code, details = code_of(kv.address, lambda c: c.put([(hexkey(1), b"x")], traffic_class=7))
    assert code == INVALID and "TrafficClass(7)" in details
    with pytest.raises(InvalidArgument, match="'batch'"):
        call(kv.address, lambda c: c.put([(hexkey(1), b"x")], traffic_class="batch"))
    assert call(kv.address, lambda c: c.get([hexkey(1)])) == [None]


def test_oversize_object_is_invalid_argument(make_server):
    kv = make_server(max_object_bytes=1000)
    code, details = code_of(kv.address, lambda c: c.put([(hexkey(2), b"x" * 1001)]))
    assert code == INVALID and hexkey(2) in details and "1000" in details
    assert call(kv.address, lambda c: c.put([(hexkey(2), b"x" * 1000)])) == 1


def test_lying_stream_sizes_are_invalid_argument(kv):
    async def put_raw(client, msgs):
        async def stream():
            for m in msgs:
                yield m
        return await client.stub.Put(stream())

    head = pb.PutRequest(header=pb.ObjectHeader(key=hexkey(3), size=10))
    for msgs in ([head, pb.PutRequest(chunk=b"x" * 11)],  # more than declared
                 [head, pb.PutRequest(chunk=b"x" * 9)],  # fewer
                 [pb.PutRequest(chunk=b"x")]):  # no header
        code, _ = code_of(kv.address, lambda c, m=msgs: put_raw(c, m))
        assert code == INVALID
    assert call(kv.address, lambda c: c.get([hexkey(3)])) == [None]
    assert call(kv.address, lambda c: c.lookup([hexkey(1)])) == 0  # still serving


def test_bad_list_limit_is_invalid_argument(kv):
    code, _ = code_of(kv.address, lambda c: c.list_page(page_size=100_000))
    assert code == INVALID


def dead_locations() -> tuple[ShardLocation, ...]:
    """12 endpoints on ports nobody listens on: S3 entirely down."""
    return tuple(ShardLocation(f"http://127.0.0.1:{free_port()}", f"dead-{i:02d}")
                 for i in range(12))


def test_s3_down_admin_unavailable_data_path_misses(make_server, tmp_path):
    kv = make_server(mem_bytes=0, disk_bytes=0)
    key = hexkey(9)
    call(kv.address, lambda c: c.put([(key, b"durable")]))
    kv.stop()
    # Same metadata, but every shard location unreachable.
    down = make_server(locations=dead_locations(), mem_bytes=0, disk_bytes=0)
    assert call(down.address, lambda c: c.get([key, hexkey(10)])) == [None, None]
    assert call(down.address, lambda c: c.lookup([key])) == 0
    for fn in (lambda c: c.stats(), lambda c: c.run_gc(dry_run=True),
               lambda c: c.list_page(), lambda c: c.scrub()):
        code, details = code_of(down.address, fn)
        assert code == grpc.StatusCode.UNAVAILABLE and "S3 is down" in details
    code, _ = code_of(down.address, lambda c: c.put([(hexkey(11), b"x")]))
    assert code == grpc.StatusCode.UNAVAILABLE
    # Records survive the outage: nothing was deleted because S3 was away.
    assert down.core.meta.current(key) is not None


def test_client_timeout_option(kv):
    async def go():
        from kvmesh.services.kvstore.client import KvstoreClient

        async with KvstoreClient(kv.address, timeout=1e-6) as c:
            await c.get([hexkey(1)] * 50)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(go())
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_config_invariants():
    locs = dead_locations()
    with pytest.raises(ValueError, match="exactly 12"):
        KvstoreConfig(locations=locs[:11])
    with pytest.raises(ValueError, match="watermark"):
        KvstoreConfig(locations=locs, low_watermark=0.9, high_watermark=0.8)
    with pytest.raises(ValueError, match="write_quorum"):
        KvstoreConfig(locations=locs, write_quorum=9)
    env = {"KVMESH_KVSTORE_LOCATIONS": ",".join(str(x) for x in locs),
           "KVMESH_KVSTORE_MEM_BYTES": "123", "KVMESH_KVSTORE_TTL_AGENT_S": "60"}
    cfg = KvstoreConfig.from_env(env, port=7200)
    assert (cfg.mem_bytes, cfg.ttl_agent_s, cfg.port, cfg.locations) == (123, 60.0, 7200, locs)
    with pytest.raises(ValueError, match="not a number"):
        KvstoreConfig.from_env({**env, "KVMESH_KVSTORE_PORT": "x"})
    with pytest.raises(ValueError, match="host:port/bucket"):
        ShardLocation.parse("127.0.0.1:9000")


def test_a_put_refused_at_its_header_is_invalid_argument_after_a_long_stream(kv):
    """The server reads a refused Put to its end before answering: answering while the client
    still writes its chunks can surface on the client as INTERNAL (grpc/grpc#36066)."""
    big = b"x" * (8 * 1024 * 1024)            # 8 chunks after the refused header
    for _ in range(3):
        code, details = code_of(kv.address, lambda c: c.put([("not-a-key", big)]))
        assert code == INVALID and "not-a-key" in details, (code, details)
    assert call(kv.address, lambda c: c.put([(hexkey(4), b"ok")])) == 1
