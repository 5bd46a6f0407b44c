"""Objects of many sizes survive a round trip through gRPC, EC and real S3."""

import os

import pytest

from tests.kvstore.conftest import call, hexkey

SIZES = [0, 1, 9, 10, 11, 1023, 65_537, 1024 * 1024 + 3, 5 * 1024 * 1024 + 7]


def test_round_trip_many_sizes_from_s3(make_server):
    # No hot tiers: every get decodes shards fetched from SeaweedFS.
    kv = make_server(mem_bytes=0, disk_bytes=0)
    items = [(hexkey(i), os.urandom(n)) for i, n in enumerate(SIZES)]
    assert call(kv.address, lambda c: c.put(items)) == len(items)
    got = call(kv.address, lambda c: c.get([k for k, _ in items]))
    assert got == [d for _, d in items]
    assert kv.core.counters["hits_s3"] == len(items)


def test_hot_tiers_serve_after_put_and_disk_after_memory_loss(kv):
    items = [(hexkey(100 + i), os.urandom(1000 * (i + 1))) for i in range(4)]
    call(kv.address, lambda c: c.put(items, traffic_class="agent"))
    assert call(kv.address, lambda c: c.get([k for k, _ in items])) == [d for _, d in items]
    assert kv.core.counters["hits_mem"] == 4
    for k, _ in items:
        kv.core.mem.drop(k)
    assert call(kv.address, lambda c: c.get([k for k, _ in items])) == [d for _, d in items]
    assert kv.core.counters["hits_disk"] == 4


def test_missing_keys_are_none_in_place(kv):
    data = os.urandom(5000)
    call(kv.address, lambda c: c.put([(hexkey(7), data)]))
    got = call(kv.address, lambda c: c.get([hexkey(6), hexkey(7), hexkey(8)]))
    assert got == [None, data, None]


def test_lookup_is_longest_stored_prefix(kv):
    chain = [hexkey(1000 + i) for i in range(6)]
    call(kv.address, lambda c: c.put([(k, b"x" * 100) for k in chain[:3] + chain[4:]]))
    assert call(kv.address, lambda c: c.lookup(chain)) == 3
    assert call(kv.address, lambda c: c.lookup(chain[3:])) == 0
    assert call(kv.address, lambda c: c.lookup([])) == 0


def test_delete_then_get_misses_and_shards_are_gone(kv):
    key = hexkey(55)
    call(kv.address, lambda c: c.put([(key, b"abc" * 1000)]))
    assert call(kv.address, lambda c: c.delete([key, hexkey(56)])) == 1
    assert call(kv.address, lambda c: c.get([key])) == [None]
    shards = kv.call(kv.core.shards.get(0, key))
    assert shards is None


def test_overwrite_returns_new_bytes(kv):
    key = hexkey(77)
    call(kv.address, lambda c: c.put([(key, b"old" * 10)]))
    call(kv.address, lambda c: c.put([(key, b"new" * 20)]))
    kv.core.mem.drop(key)
    kv.core.disk.drop(key)
    assert call(kv.address, lambda c: c.get([key])) == [b"new" * 20]


@pytest.mark.parametrize("width", [32, 128])
def test_key_length_bounds_accepted(kv, width):
    key = "a" * width
    call(kv.address, lambda c: c.put([(key, b"1")]))
    assert call(kv.address, lambda c: c.get([key])) == [b"1"]
