"""GC: TTL per class, LRU under capacity, dry run, restart, concurrent reads, orphans."""

import asyncio
import os
import random
import threading
import time

from kvmesh.services.kvstore import ec
from kvmesh.services.kvstore.config import DAY
from kvmesh.services.kvstore.meta import Record
from tests.kvstore.conftest import call, hexkey


def keys_of(kv) -> set[str]:
    return {k for k, r in kv.core.meta.items() if r.complete}


def test_ttl_expiry_per_traffic_class(kv, clock):
    agent = [(hexkey(i), b"a" * 10) for i in range(3)]
    chat = [(hexkey(10 + i), b"c" * 10) for i in range(3)]
    call(kv.address, lambda c: c.put(agent, traffic_class="agent"))
    call(kv.address, lambda c: c.put(chat, traffic_class="chatbot"))
    clock.advance(2 * DAY)
    call(kv.address, lambda c: c.get([agent[0][0], chat[0][0]]))  # refresh one of each
    clock.advance(1.5 * DAY)  # agent untouched for 3.5 days: past its 3-day TTL
    report = call(kv.address, lambda c: c.run_gc())
    assert sorted(report.expired) == [agent[1][0], agent[2][0]]
    clock.advance(4 * DAY)  # chatbot untouched 7.5 days, refreshed ones 5.5 days
    report = call(kv.address, lambda c: c.run_gc())
    assert sorted(report.expired) == sorted([agent[0][0], chat[1][0], chat[2][0]])
    assert keys_of(kv) == {chat[0][0]}
    assert call(kv.address, lambda c: c.get([agent[1][0], chat[0][0]])) == [None, b"c" * 10]
    assert kv.call(kv.core.shards.get(0, agent[1][0])) is None
    counters = kv.core.counters           # what the metrics endpoint exports
    assert (counters["gc_runs"], counters["gc_expired"], counters["gc_deleted"]) == (2, 5, 5)
    assert counters["gc_bytes_freed"] == 50


def test_lru_under_capacity_pressure_exact_survivors(make_server, clock):
    # capacity 10_000: GC starts above 9_000 and evicts down to 8_000.
    kv = make_server(capacity_bytes=10_000)
    keys = [hexkey(200 + i) for i in range(10)]
    for k in keys:  # each 1_000 bytes, 10_000 in all; put order = age order
        call(kv.address, lambda c, k=k: c.put([(k, os.urandom(1000))]))
        clock.advance(1)
    call(kv.address, lambda c: c.get([keys[0], keys[1]]))  # now the most recent
    report = call(kv.address, lambda c: c.run_gc())
    assert list(report.evicted) == [keys[2], keys[3]]
    assert keys_of(kv) == set(keys) - {keys[2], keys[3]}
    assert report.bytes_freed == 2000
    report = call(kv.address, lambda c: c.run_gc())  # at 8_000: below the high mark
    assert list(report.evicted) == []


def test_dry_run_changes_nothing(make_server, clock):
    kv = make_server(capacity_bytes=3000)
    items = [(hexkey(300 + i), os.urandom(1000)) for i in range(3)]
    call(kv.address, lambda c: c.put(items, traffic_class="agent"))
    clock.advance(4 * DAY)
    before = {k: (r.last_access, r.generation) for k, r in kv.core.meta.items()}
    report = call(kv.address, lambda c: c.run_gc(dry_run=True))
    assert report.dry_run and sorted(report.expired) == sorted(k for k, _ in items)
    assert {k: (r.last_access, r.generation) for k, r in kv.core.meta.items()} == before
    kv.core.mem.drop(items[0][0])
    kv.core.disk.drop(items[0][0])
    assert call(kv.address, lambda c: c.get([items[0][0]])) == [items[0][1]]  # from S3


def test_restart_keeps_access_times(make_server, clock, tmp_path):
    kv = make_server(data_dir=tmp_path / "kv1")
    a, b = hexkey(401), hexkey(402)
    call(kv.address, lambda c: c.put([(a, b"A" * 10), (b, b"B" * 10)]))
    clock.advance(2 * DAY)
    call(kv.address, lambda c: c.get([a]))
    touched = clock()
    kv.stop()  # flushes access times
    kv2 = make_server(data_dir=tmp_path / "kv1")
    assert kv2.core.meta.get(a).last_access == touched
    assert kv2.core.meta.get(b).last_access == touched - 2 * DAY
    clock.advance(5.5 * DAY)  # b: 7.5 days idle -> expired; a: 5.5 days -> kept
    report = call(kv2.address, lambda c: c.run_gc())
    assert list(report.expired) == [b]
    assert call(kv2.address, lambda c: c.get([a, b])) == [b"A" * 10, None]


def test_gc_during_concurrent_reads_never_corrupts(make_server, clock):
    # No hot tiers: readers decode from S3 while GC deletes the same objects.
    # Capacity far below the data: every object not being read is evicted.
    kv = make_server(mem_bytes=0, disk_bytes=0, capacity_bytes=10_000)
    items = {hexkey(600 + i): os.urandom(30_000 + i) for i in range(12)}
    call(kv.address, lambda c: c.put(list(items.items())))
    results: list[tuple[str, bytes | None]] = []
    stop = threading.Event()

    def reader():
        async def loop():
            from kvmesh.services.kvstore.client import KvstoreClient

            async with KvstoreClient(kv.address, timeout=30) as c:
                rng = random.Random(threading.get_ident())
                while not stop.is_set():
                    keys = rng.sample(list(items), 3)
                    for k, v in zip(keys, await c.get(keys), strict=True):
                        results.append((k, v))

        asyncio.run(loop())

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    removed: set[str] = set()
    for _ in range(30):
        r = call(kv.address, lambda c: c.run_gc())
        removed |= set(r.evicted)
        if removed == set(items):
            break
    stop.set()
    for t in threads:
        t.join(30)
    assert removed == set(items), "GC eventually removes every object"
    assert results, "readers ran"
    for k, v in results:
        assert v is None or v == items[k]
    assert call(kv.address, lambda c: c.get(list(items))) == [None] * len(items)


def test_orphan_shards_removed_after_grace(kv, clock):
    kept = hexkey(701)
    call(kv.address, lambda c: c.put([(kept, b"keep me")]))
    # A crash mid-put: shards reached S3, the record never did.
    orphan = hexkey(702)
    shards = ec.encode(kv.core.cfg.layout, orphan, 1, b"half written" * 100)
    for i, blob in enumerate(shards[:7]):
        assert kv.call(kv.core.shards.put(i, orphan, blob))
    # A crash between begin and commit: a stale complete=0 record.
    stale = hexkey(703)
    kv.core.meta.begin_put(stale, 5, 100, "chatbot", clock())
    for i, blob in enumerate(ec.encode(kv.core.cfg.layout, stale, 5, b"s" * 100)):
        kv.call(kv.core.shards.put(i, stale, blob))
    report = call(kv.address, lambda c: c.run_gc())
    assert list(report.orphans) == [] and list(report.stale) == []  # inside the grace
    # Shard ages come from S3's LastModified (real time), which runs ahead of the fake
    # clock by however long the set-up took on a loaded machine: catch up first.
    clock.now = max(clock.now, time.time())
    clock.advance(kv.core.cfg.orphan_grace_s + 5)
    report = call(kv.address, lambda c: c.run_gc(dry_run=True))
    assert (list(report.orphans), list(report.stale)) == ([orphan], [stale])
    assert kv.call(kv.core.shards.get(0, orphan)) is not None
    report = call(kv.address, lambda c: c.run_gc())
    assert (list(report.orphans), list(report.stale)) == ([orphan], [stale])
    for i in range(12):
        assert kv.call(kv.core.shards.get(i, orphan)) is None
        assert kv.call(kv.core.shards.get(i, stale)) is None
    assert call(kv.address, lambda c: c.get([kept])) == [b"keep me"]
    assert isinstance(kv.core.meta.get(kept), Record)
