"""Router choices, exactly: snapshot depth, affinity, load, leases, failures."""

from __future__ import annotations

from kvmesh.directory_records import EngineInfo, EngineLoad, Holder
from kvmesh.services.gateway.router import Router

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
KEYS = ["k128", "k256", "k384"]


def holder(addr, pos):
    return Holder("e", addr, pos, 1, 1000)


def info(addr, lease_ms=10_000, running=0, waiting=0):
    return EngineInfo(addr, addr, EngineLoad(running, waiting, 1, 1), 0, lease_ms, 1, 0)


def test_deepest_snapshot_wins_over_affinity():
    r = Router([A, B, C])
    r.remember(KEYS, A)
    holders = {"k128": [holder(B, 128)], "k256": [holder(C, 256)]}
    c = r.pick(0.0, KEYS, holders)
    assert (c.engine.address, c.reason, c.cached_tokens) == (C, "snapshot", 256)


def test_affinity_uses_longest_shared_prefix():
    r = Router([A, B, C])
    r.remember(KEYS[:1], A)
    r.remember(KEYS[:2], B)  # B served a longer prefix later
    assert r.pick(0.0, KEYS).engine.address == B
    assert r.pick(0.0, KEYS[:1]).engine.address == B  # k128 was overwritten by B
    assert r.pick(0.0, ["other"]).reason == "load"


def test_busy_preferred_engine_is_skipped():
    r = Router([A, B], max_imbalance=2)
    r.remember(KEYS, A)
    r.engines[A].in_flight = 3
    c = r.pick(0.0, KEYS)
    assert (c.engine.address, c.reason) == (B, "load")
    r.engines[A].in_flight = 2
    assert r.pick(0.0, KEYS).engine.address == A


def test_least_load_counts_gateway_and_directory_load():
    r = Router([A, B])
    r.update_from_directory([info(A, running=2), info(B, waiting=1)], now=0.0)
    assert r.pick(0.0).engine.address == B
    r.engines[B].in_flight = 2
    assert r.pick(0.0).engine.address == A


def test_lapsed_lease_is_never_chosen():
    r = Router()
    r.update_from_directory([info(A, lease_ms=1000), info(B, lease_ms=5000)], now=0.0)
    assert {st.address for st in r.candidates(0.5)} == {A, B}
    assert {st.address for st in r.candidates(2.0)} == {B}
    r.update_from_directory([], now=6.0)  # directory silent: leases run out, engines dropped
    assert r.pick(6.0) is None and r.engines == {}


def test_a_static_engines_stale_queue_is_forgotten_when_its_lease_lapses():
    """A static engine whose last heartbeat showed work, then nothing (it died, or the
    directory did): its load is what this gateway sends it again, so it gets chosen."""
    r = Router([A, B])
    r.update_from_directory([info(A, lease_ms=1000), info(B, lease_ms=1000, running=1)], now=0.0)
    assert {r.pick(0.5).engine.address for _ in range(4)} == {A}
    r.update_from_directory([info(A, lease_ms=10_000)], now=2.0)   # B's lease lapsed
    assert r.engines[B].queued == 0
    assert {r.pick(2.0).engine.address for _ in range(4)} == {A, B}


def test_failed_engine_avoided_until_down_period_ends():
    r = Router([A, B])
    r.mark_down(A, until=2.0)
    assert {r.pick(1.0).engine.address for _ in range(4)} == {B}
    assert r.pick(1.0, exclude=[B]).engine.address == A  # nothing else left: try it anyway
    assert {r.pick(3.0).engine.address for _ in range(4)} == {A, B}


def test_affinity_map_is_bounded_lru():
    r = Router([A], affinity_entries=3)
    r.remember(["1", "2", "3"], A)
    r.remember(["4"], A)
    assert list(r.affinity) == ["2", "3", "4"]
