"""A batch Lookup of 1,000 keys costs exactly one round trip to Redis.

Three independent witnesses, all read around one Lookup RPC:
  1. client side: writes on the directory's redis-py connections (the send path
     is wrapped; one write = one request/response exchange);
  2. server side, global: INFO commandstats `cmdstat_evalsha` calls;
  3. server side, per connection: CLIENT LIST `tot-cmds` of the directory's
     connections (they carry CLIENT_NAME). Valkey counts the commands a script
     runs on behalf of a client in its tot-cmds too, so we subtract those (the
     commandstats deltas of everything but EVALSHA and the observer's own
     INFO / CLIENT LIST) and must be left with exactly one request.
A private Valkey keeps other tests' traffic out of the counters.
"""

from __future__ import annotations

import pytest
import redis
from redis.asyncio.connection import AbstractConnection

from kvmesh.directory_records import Entry
from kvmesh.launch.backing.valkey import ValkeyProcess
from kvmesh.services.directory.core import CLIENT_NAME


def key(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture
def private_valkey():
    with ValkeyProcess() as server:
        yield server


def directory_cmds(r: redis.Redis) -> int:
    return sum(int(c["tot-cmds"]) for c in r.client_list() if c["name"] == CLIENT_NAME)


def command_calls(r: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in r.info("commandstats").items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def test_batch_lookup_of_1000_keys_is_one_round_trip(make_directory, private_valkey, monkeypatch):
    h = make_directory(redis=private_valkey, sweep_interval_s=3600)  # no sweeper traffic
    keys = [key(i) for i in range(1000)]
    h.run(h.client.heartbeat("e1", "127.0.0.1:7001"))
    h.run(h.client.heartbeat("e2", "127.0.0.1:7002"))
    h.run(h.client.publish("e1", [Entry(k, 128, 528) for k in keys[:600]]))
    h.run(h.client.publish("e2", [Entry(k, 256, 528) for k in keys[300:700]]))
    h.run(h.client.lookup(keys[:1]))  # warm-up: script cached, connection open

    writes: list = []
    original = AbstractConnection.send_packed_command

    async def counting(self, command, check_health=True):
        if self.client_name == CLIENT_NAME:
            writes.append(command)
        return await original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    observer = redis.Redis.from_url(private_valkey.url, decode_responses=True)
    cmds_before, stats_before = directory_cmds(observer), command_calls(observer)

    got = h.run(h.client.lookup(keys))

    cmds_after, stats_after = directory_cmds(observer), command_calls(observer)
    assert len(writes) == 1
    ran = delta(stats_after, stats_before)
    assert ran.pop("evalsha") == 1
    ran.pop("info", None), ran.pop("client|list", None)  # the observer's own calls
    assert ran["hgetall"] == 1000  # inside the script, on the server
    assert cmds_after - cmds_before - sum(ran.values()) == 1
    # ...and the one round trip answered all 1,000 keys correctly.
    assert len(got) == 1000
    held_by = [sorted(h.engine_id for h in got[k]) for k in keys]
    assert held_by[:300] == [["e1"]] * 300
    assert held_by[300:600] == [["e1", "e2"]] * 300
    assert held_by[600:700] == [["e2"]] * 100
    assert held_by[700:] == [[]] * 300
    observer.close()


def test_publish_and_withdraw_batches_are_one_round_trip_each(make_directory, private_valkey):
    h = make_directory(redis=private_valkey, sweep_interval_s=3600)
    observer = redis.Redis.from_url(private_valkey.url, decode_responses=True)
    h.run(h.client.heartbeat("e1", "127.0.0.1:7001"))
    keys = [key(i) for i in range(1000)]
    h.run(h.client.publish("e1", [Entry(keys[0], 128, 1)]))  # warm-up
    for call in (lambda: h.client.publish("e1", [Entry(k, 128, 1) for k in keys]),
                 lambda: h.client.withdraw("e1", keys)):
        before = command_calls(observer)
        assert h.run(call()) == 1000
        ran = delta(command_calls(observer), before)
        assert ran.get("evalsha") == 1 and "eval" not in ran and "multi" not in ran
    observer.close()
