"""Two kvstores (in-process, real gRPC sockets) over the same 12 locations and one shared
index in a real Valkey: what one writes, overwrites, deletes or collects, the other sees;
a read racing another replica's delete/overwrite is a miss or the bytes of a version put
under that key, never other bytes; one GC at a time; a client pool falls over."""

from __future__ import annotations

import asyncio
import os
import threading

import grpc
import pytest

from kvmesh.errors import Unavailable
from kvmesh.services.kvstore.client import KvstorePool, connect
from kvmesh.services.kvstore.config import DAY
from kvmesh.services.kvstore.shards import RUN_PREFIX
from tests.kvstore.conftest import call, hexkey
from tests.kvstore.test_runs import s3_objects


@pytest.fixture
def pair(make_server, tmp_path, shared_index):
    a = make_server(data_dir=tmp_path / "a", replica="a", **shared_index)
    b = make_server(data_dir=tmp_path / "b", replica="b", mem_bytes=0, disk_bytes=0,
                    **shared_index)
    return a, b


def test_one_index_two_replicas(pair, clock):
    a, b = pair
    items = [(hexkey(100 + i), os.urandom(30_000 + i)) for i in range(16)]
    single = (hexkey(1), os.urandom(5000))
    call(a.address, lambda c: c.put(items, traffic_class="agent"))
    call(a.address, lambda c: c.put([single]))
    keys = [k for k, _ in items]
    assert call(b.address, lambda c: c.get(keys + [single[0]])) == [d for _, d in items] + [single[1]]
    assert call(b.address, lambda c: c.lookup(keys)) == 16
    # B overwrites 4 blocks (a run of its own): A, whose memory tier holds the old
    # versions, serves the new ones (its tier entries are per generation).
    new = [(k, os.urandom(1000)) for k in keys[:4]]
    call(b.address, lambda c: c.put(new))
    assert call(a.address, lambda c: c.get(keys[:5])) == [d for _, d in new] + [items[4][1]]
    # A deletes two: B misses them; stats agree on both replicas.
    assert call(a.address, lambda c: c.delete(keys[4:6])) == 2
    assert call(b.address, lambda c: c.get(keys[4:7])) == [None, None, items[6][1]]
    sa, sb = (call(x.address, lambda c: c.stats()) for x in (a, b))
    assert sa.objects == sb.objects == 15 and sa.bytes == sb.bytes
    # GC on B: the agent blocks expire after 3 days; the chatbot ones (B's overwrites,
    # the single object) stay. The first run (all its blocks now gone) is reclaimed,
    # shards and all, by B's pass; B's run stays.
    clock.advance(3.5 * DAY)
    rep = call(b.address, lambda c: c.run_gc())
    assert sorted(rep.expired) == sorted(keys[6:])
    assert call(a.address, lambda c: c.get(keys + [single[0]])) == (
        [d for _, d in new] + [None] * 12 + [single[1]])
    kept = a.core.meta.get(keys[0]).run
    assert s3_objects(a, RUN_PREFIX) == [[kept]] * 12 and list(a.core.meta.runs) == [kept]
    hist = a.core.lease.history()
    assert [(h["holder"], h["what"]) for h in hist] == [("b", "gc")]


def test_gc_refused_while_another_replica_holds_the_lease(pair):
    a, b = pair

    async def hold_and_try():
        async with b.core.lease.hold("gc"):
            with pytest.raises(Unavailable, match="held by b"):
                await a.core.run_gc()
            await a.core.run_gc(dry_run=True)  # a dry run changes nothing: no lease
        await a.core.run_gc()

    a.call(hold_and_try())
    with pytest.raises(grpc.aio.AioRpcError) as err:  # over gRPC: UNAVAILABLE, naming it
        b.call(_holding(b, lambda: call(a.address, lambda c: c.run_gc(), timeout=10)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "held by b" in err.value.details()


async def _holding(srv, fn):
    async with srv.core.lease.hold("gc"):
        return await asyncio.to_thread(fn)


def test_reads_racing_other_replica_deletes_and_overwrites(pair):
    """A reads a key set over and over while B deletes and re-puts it with other bytes
    (as runs): every answer is None or exactly one version that was put under the key."""
    a, b = pair
    keys = [hexkey(500 + i) for i in range(8)]
    versions = {v: [os.urandom(20_000 + v) for _ in keys] for v in range(6)}
    call(b.address, lambda c: c.put(list(zip(keys, versions[0], strict=True))))
    stop = threading.Event()
    seen = {"reads": 0, "hits": 0, "wrong": 0}

    def reader():
        async def go():
            async with connect(a.address, timeout=10) as c:
                while not stop.is_set():
                    got = await c.get(keys)
                    seen["reads"] += 1
                    for i, data in enumerate(got):
                        if data is not None:
                            seen["hits"] += 1
                            if all(data != versions[v][i] for v in versions):
                                seen["wrong"] += 1
        asyncio.run(go())

    t = threading.Thread(target=reader)
    t.start()
    try:
        for v in range(1, 6):
            call(b.address, lambda c: c.delete(keys[::2]))
            call(b.address, lambda c, v=v: c.put(list(zip(keys, versions[v], strict=True))))
    finally:
        stop.set()
        t.join(30)
    assert seen["wrong"] == 0 and seen["reads"] > 3 and seen["hits"] > 0, seen
    assert call(a.address, lambda c: c.get(keys)) == versions[5]


def test_pool_spreads_by_key_and_falls_over(pair):
    a, b = pair
    items = {hexkey(900 + i): os.urandom(3000) for i in range(12)}

    async def go():
        pool = connect(f"{a.address},{b.address}", timeout=10)
        assert isinstance(pool, KvstorePool)
        for k, d in items.items():
            await pool.put([(k, d)])
        want = [[d] for d in items.values()]
        assert [await pool.get([k]) for k in items] == want, _counters(a, b)
        spread = list(pool.calls)
        a.stop()  # replica a gone: every call lands on b
        assert [await pool.get([k]) for k in items] == want, _counters(b)
        await pool.close()
        return spread

    spread = asyncio.run(go())
    assert min(spread) >= 4, spread  # 24 calls over 2 replicas, by key hash


def _counters(*servers) -> str:
    """What a failed exact-read assertion should say: misses, hedged and timed-out reads."""
    return "; ".join(f"{s.core.cfg.replica}: {dict(s.core.counters)}" for s in servers)


def test_shared_index_lost_then_reindexed(pair, clock, shared_index):
    """The whole shared index wiped from Valkey: `reindex` on one replica brings every
    object back for both, exact; GC afterwards still honours the TTL classes."""
    a, b = pair
    agent = [(hexkey(40 + i), os.urandom(9000 + i)) for i in range(10)]
    chat = [(hexkey(60 + i), os.urandom(7000 + i)) for i in range(5)]
    call(a.address, lambda c: c.put(agent, traffic_class="agent"))
    call(a.address, lambda c: c.put(chat, traffic_class="chatbot"))
    single = (hexkey(80), os.urandom(4000))
    call(b.address, lambda c: c.put([single]))
    r = a.core.meta.redis
    wiped = [k for k in r.scan_iter(shared_index["index_prefix"] + ":*")]
    assert len(wiped) >= 5 and r.delete(*wiped) == len(wiped)
    every = agent + chat + [single]
    keys = [k for k, _ in every]
    assert call(a.address, lambda c: c.get(keys)) == [None] * len(keys)
    rep = call(b.address, lambda c: c.reindex())
    assert (rep.runs, rep.restored) == (2, len(keys))
    for srv in (a, b):
        assert call(srv.address, lambda c: c.get(keys)) == [d for _, d in every]
    clock.advance(3.5 * DAY)
    assert sorted(call(a.address, lambda c: c.run_gc()).expired) == sorted(k for k, _ in agent)
    assert call(b.address, lambda c: c.get(keys)) == [None] * 10 + [d for _, d in chat + [single]]


def test_redis_outage_is_unavailable_and_the_index_persists(make_server, tmp_path):
    """Its own Valkey with the append-only file on (as `kvmesh up` runs it): while it is
    down every call is UNAVAILABLE (nothing crashes); restarted, it has the index back
    from disk and every object is served exact."""
    from kvmesh.launch.backing.valkey import ValkeyProcess

    with ValkeyProcess(work_dir=tmp_path / "valkey", persist=True) as v:
        kv = make_server(data_dir=tmp_path / "kv", mem_bytes=0, disk_bytes=0, index=v.url)
        items = [(hexkey(20 + i), os.urandom(5000)) for i in range(6)]
        call(kv.address, lambda c: c.put(items))
        v.stop()
        for fn in (lambda c: c.get([items[0][0]]), lambda c: c.put(items[:2]),
                   lambda c: c.run_gc()):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                call(kv.address, fn, timeout=20)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        v.start()
        assert call(kv.address, lambda c: c.get([k for k, _ in items])) == [d for _, d in items]
