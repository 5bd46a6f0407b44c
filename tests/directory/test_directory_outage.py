"""Redis down -> UNAVAILABLE fast; Redis back on the same port -> same directory serves again."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import errors
from kvmesh.directory_records import Entry
from kvmesh.launch.backing.valkey import ValkeyProcess

# With redis_timeout 1 s / connect 0.5 s / one retry, a refused connection fails
# in milliseconds; the bound leaves room for a slow CI machine, not for a hang.
UNAVAILABLE_WITHIN_S = 2.0


def key(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture
def flaky_valkey():
    with ValkeyProcess() as server:
        yield server


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status


def test_redis_outage_gives_unavailable_then_recovers_without_restart(make_directory,
                                                                      flaky_valkey):
    h = make_directory(redis=flaky_valkey, sweep_interval_s=0.2)
    c = h.client
    port = flaky_valkey.port
    h.run(c.heartbeat("e1", "127.0.0.1:7001"))
    h.run(c.publish("e1", [Entry(key(1), 128, 1)]))
    assert health(h.address) == health_pb2.HealthCheckResponse.SERVING

    flaky_valkey.stop()
    calls = {
        "lookup": lambda: c.lookup([key(1)], timeout=10),
        "publish": lambda: c.publish("e1", [Entry(key(2), 128, 1)], timeout=10),
        "heartbeat": lambda: c.heartbeat("e1", "127.0.0.1:7001", timeout=10),
        "withdraw": lambda: c.withdraw("e1", [key(1)], timeout=10),
        "list_engines": lambda: c.list_engines(timeout=10),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable, match="UNAVAILABLE: redis unavailable"):
            h.run(call())
        elapsed = time.monotonic() - t0
        assert elapsed < UNAVAILABLE_WITHIN_S, f"{name} took {elapsed:.2f}s"
    # What engines call on the request path: no exception, just "nobody holds it".
    assert h.run(c.find_holders([key(1)])) == {key(1): []}
    deadline = time.monotonic() + 3
    while health(h.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health did not report NOT_SERVING"
        time.sleep(0.1)

    flaky_valkey.start()  # same port, empty: no persistence
    assert flaky_valkey.port == port
    # The lease is gone with Redis' memory: publish says so, heartbeat re-registers.
    with pytest.raises(errors.NotFound, match="send Heartbeat first"):
        h.run(c.publish("e1", [Entry(key(1), 128, 1)]))
    assert h.run(c.heartbeat("e1", "127.0.0.1:7001")).new_lease
    assert h.run(c.publish("e1", [Entry(key(1), 128, 1), Entry(key(2), 256, 2)])) == 2
    got = h.run(c.lookup([key(1), key(2)]))
    assert [(x.engine_id, x.position) for k in (key(1), key(2)) for x in got[k]] == [
        ("e1", 128), ("e1", 256)]
    deadline = time.monotonic() + 3
    while health(h.address) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "health did not come back to SERVING"
        time.sleep(0.1)


def test_directory_starts_while_redis_is_down_and_serves_once_it_is_up(make_directory):
    valkey = ValkeyProcess()  # port chosen, server not started yet
    try:
        h = make_directory(redis=valkey, sweep_interval_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable):
            h.run(h.client.lookup([key(1)], timeout=10))
        assert time.monotonic() - t0 < UNAVAILABLE_WITHIN_S
        valkey.start()
        h.run(h.client.heartbeat("e1", "127.0.0.1:7001"))
        assert h.run(h.client.publish("e1", [Entry(key(1), 128, 1)])) == 1
        assert [x.engine_id for x in h.run(h.client.lookup([key(1)]))[key(1)]] == ["e1"]
    finally:
        valkey.close()


def test_hung_redis_gives_unavailable_within_the_op_timeout(make_directory, flaky_valkey):
    # A paused server accepts TCP connections but never answers: only timeouts help.
    h = make_directory(redis=flaky_valkey, sweep_interval_s=3600, redis_timeout_s=0.3,
                       op_timeout_s=1.0)
    h.run(h.client.heartbeat("e1", "127.0.0.1:7001"))
    flaky_valkey.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable, match="redis unavailable"):
            h.run(h.client.lookup([key(1)], timeout=10))
        assert time.monotonic() - t0 < 1.0 + 0.5
    finally:
        flaky_valkey.resume()
    assert h.run(h.client.lookup([key(1)])) == {key(1): []}


def test_stop_ends_even_when_a_sweep_turns_the_cancel_into_unavailable(make_directory):
    """A sweep pass whose op timeout meets the stop's cancel can end as one more Unavailable
    (the sweeper then loops on). The stop still ends, within op_timeout_s + grace, and the
    sweeper with it (its loop checks the stop); a teardown once waited 30 s here."""
    import asyncio

    h = make_directory(sweep_interval_s=0.05, op_timeout_s=0.5)

    async def stubborn():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise errors.Unavailable("redis unavailable (the cancel, swallowed)") from None

    h.directory.sweep_once = stubborn
    time.sleep(0.3)                                   # a pass is in flight
    t0 = time.monotonic()
    h.run(h.server.stop(grace=0.2))
    assert time.monotonic() - t0 < 0.5 + 0.2 + 1.0
    assert h.server._sweeper.done()
