"""Host-memory snapshot store: byte bound (LRU), TTL, foreign layouts refused."""

from kvmesh.services.engine.cache.snapshots import Snapshot, SnapshotStore


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def snap(key, n=100, layout="L", model="M", t=1000.0):
    return Snapshot(key, 128, layout, model, bytes(n), t)


def test_lru_under_the_byte_bound():
    evicted = []
    store = SnapshotStore(250, ttl_min=10, layout_fp="L", model_fp="M", clock=Clock(),
                          on_evict=evicted.append)
    store.put(snap("a"))
    store.put(snap("b"))
    assert store.get("a") is not None          # a is now the most recent
    store.put(snap("c"))                       # 300 B > 250: the least recent (b) goes
    assert store.keys() == ["a", "c"] and evicted == ["b"] and store.bytes == 200
    assert not store.put(snap("huge", n=251))  # larger than the whole store


def test_ttl_expiry_and_withdraw_notice():
    clock, evicted = Clock(), []
    store = SnapshotStore(10_000, ttl_min=1, layout_fp="L", model_fp="M", clock=clock,
                          on_evict=evicted.append)
    store.put(snap("a", t=clock()))
    clock.t += 59
    store.put(snap("b", t=clock()))
    clock.t += 2                               # a is 61 s old, b 2 s
    assert "a" not in store and "b" in store
    assert evicted == ["a"]
    clock.t += 60
    assert store.expire() == 1 and len(store) == 0 and store.bytes == 0


def test_foreign_layout_or_model_is_refused_and_dropped():
    store = SnapshotStore(10_000, ttl_min=10, layout_fp="L", model_fp="M", clock=Clock())
    store.put(snap("x", layout="other"))
    store.put(snap("y", model="other"))
    assert store.get("x") is None and store.get("y") is None
    assert store.refused == 2 and len(store) == 0


def test_a_peers_read_changes_nothing():
    """peek (FetchSwaSnapshot): no LRU touch, no removal; what get would refuse it withholds."""
    clock, evicted = Clock(), []
    store = SnapshotStore(250, ttl_min=1, layout_fp="L", model_fp="M", clock=clock,
                          on_evict=evicted.append)
    store.put(snap("a", t=clock()))
    store.put(snap("b", t=clock()))
    assert store.peek("a") is not None and store.keys() == ["a", "b"]   # a stays least recent
    store.put(snap("c", t=clock()))
    assert store.keys() == ["b", "c"] and evicted == ["a"]
    clock.t += 61
    assert store.peek("b") is None and store.keys() == ["b", "c"]       # expired, left in place
