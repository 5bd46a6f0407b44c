"""Publish / lookup / expiry / lease lapse / withdraw against a real Valkey over gRPC."""

from __future__ import annotations

import time

import pytest
import redis

from kvmesh import errors
from kvmesh.directory_records import EngineLoad, Entry


def key(i: int) -> str:
    return f"{i:064x}"


def wait_until(pred, timeout: float = 5.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout}s")


def test_publish_then_lookup_returns_holder_with_address(directory):
    c = directory.client
    grant = directory.run(c.heartbeat("eng-a", "10.0.0.7:7001", EngineLoad(3, 1, 12, 900)))
    assert grant.new_lease and grant.epoch == 1 and grant.lease_ttl_ms == 10_000
    assert directory.run(c.publish("eng-a", [Entry(key(1), 256, 2 * 134 * 528)])) == 1

    got = directory.run(c.lookup([key(1), key(2)]))
    assert list(got) == [key(1), key(2)]
    [holder] = got[key(1)]
    assert (holder.engine_id, holder.address, holder.position, holder.size_bytes) == (
        "eng-a", "10.0.0.7:7001", 256, 141_504)
    assert 1_790_000 < holder.ttl_ms <= 1_800_000  # default entry TTL: 30 min
    assert got[key(2)] == []

    [info] = directory.run(c.list_engines())
    assert (info.engine_id, info.address, info.load, info.epoch, info.entries) == (
        "eng-a", "10.0.0.7:7001", EngineLoad(3, 1, 12, 900), 1, 1)
    assert info.heartbeat_age_ms < 2_000 and 0 < info.lease_left_ms <= 10_000


def test_two_engines_hold_the_same_key_and_renewal_keeps_the_epoch(directory):
    c = directory.client
    directory.run(c.heartbeat("a", "host-a:1"))
    directory.run(c.heartbeat("b", "host-b.example:2"))
    directory.run(c.publish("a", [Entry(key(7), 128, 10)]))
    directory.run(c.publish("b", [Entry(key(7), 128, 10)]))
    holders = directory.run(c.lookup([key(7)]))[key(7)]
    assert sorted((h.engine_id, h.address) for h in holders) == [
        ("a", "host-a:1"), ("b", "host-b.example:2")]
    again = directory.run(c.heartbeat("a", "host-a:1"))
    assert (again.epoch, again.new_lease) == (1, False)
    assert [e.engine_id for e in directory.run(c.list_engines())] == ["a", "b"]


def test_entry_ttl_expires(directory):
    c = directory.client
    directory.run(c.heartbeat("e1", "127.0.0.1:9000"))
    directory.run(c.publish("e1", [Entry(key(1), 128, 1, ttl_s=1), Entry(key(2), 128, 1)]))
    assert directory.run(c.lookup([key(1)]))[key(1)]
    time.sleep(1.1)
    got = directory.run(c.lookup([key(1), key(2)]))
    assert got[key(1)] == [] and len(got[key(2)]) == 1
    assert directory.run(c.list_engines())[0].entries == 1


def test_lapsed_heartbeat_removes_engine_and_its_entries(make_directory, valkey):
    h = make_directory(lease_ttl_s=0.5, sweep_interval_s=0.2)
    c = h.client
    h.run(c.heartbeat("dies", "127.0.0.1:9001"))
    h.run(c.heartbeat("lives", "127.0.0.1:9002"))
    keys = [key(i) for i in range(50)]
    h.run(c.publish("dies", [Entry(k, 128, 1) for k in keys]))
    h.run(c.publish("lives", [Entry(keys[0], 128, 1)]))

    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # only "lives" keeps heartbeating
        h.run(c.heartbeat("lives", "127.0.0.1:9002"))
        time.sleep(0.1)
    got = h.run(c.lookup(keys))
    assert [x.engine_id for x in got[keys[0]]] == ["lives"]
    assert all(got[k] == [] for k in keys[1:])
    assert [e.engine_id for e in h.run(c.list_engines())] == ["lives"]

    # The sweeper deletes what the lapsed lease published, not only hides it.
    r = redis.Redis.from_url(valkey.url, decode_responses=True)
    p = h.config.key_prefix
    wait_until(lambda: not r.exists(f"{p}:held:dies:1") and not r.smembers(f"{p}:orphans"))
    assert r.hkeys(f"{p}:snap:{keys[0]}") == ["lives"]
    assert not any(r.exists(f"{p}:snap:{k}") for k in keys[1:])
    assert r.zscore(f"{p}:engines", "dies") is None
    with pytest.raises(errors.NotFound, match="engine dies is not registered; send Heartbeat"):
        h.run(c.publish("dies", [Entry(key(1), 128, 1)]))


def test_reregistered_engine_does_not_resurrect_old_entries(make_directory):
    h = make_directory(lease_ttl_s=0.3, sweep_interval_s=3600)  # no sweeper: epochs alone hide
    c = h.client
    h.run(c.heartbeat("e", "127.0.0.1:1"))
    h.run(c.publish("e", [Entry(key(1), 128, 1)]))
    time.sleep(0.4)
    grant = h.run(c.heartbeat("e", "127.0.0.1:1"))
    assert (grant.epoch, grant.new_lease) == (2, True)
    assert h.run(c.lookup([key(1)]))[key(1)] == []


def test_restarted_flag_drops_entries_of_a_live_lease(directory):
    c = directory.client
    directory.run(c.heartbeat("e", "127.0.0.1:1"))
    directory.run(c.publish("e", [Entry(key(1), 128, 1)]))
    grant = directory.run(c.heartbeat("e", "127.0.0.1:1", restarted=True))
    assert (grant.epoch, grant.new_lease) == (2, True)
    assert directory.run(c.lookup([key(1)]))[key(1)] == []
    report = directory.run(directory.directory.sweep_once())
    assert (report.purged, report.orphans_left) == (1, 0)


def test_withdraw_removes(directory):
    c = directory.client
    directory.run(c.heartbeat("e", "127.0.0.1:1"))
    directory.run(c.publish("e", [Entry(key(i), 128 * i, 1) for i in range(1, 4)]))
    assert directory.run(c.withdraw("e", [key(1), key(3), key(9)])) == 2
    got = directory.run(c.lookup([key(1), key(2), key(3)]))
    assert [len(got[key(i)]) for i in (1, 2, 3)] == [0, 1, 0]
    assert got[key(2)][0].position == 256
    assert directory.run(c.list_engines())[0].entries == 1
