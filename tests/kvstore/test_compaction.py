"""Compaction of mostly-dead runs (compaction.py), on the sqlite index and the shared
one: the live blocks move to a new run and the old run's shards go; reads racing it
never see other bytes; TTL classes and access times survive the move."""

from __future__ import annotations

import os
import threading

import pytest

from kvmesh.services.kvstore.config import DAY
from kvmesh.services.kvstore.shards import RUN_PREFIX
from tests.kvstore.conftest import call, hexkey
from tests.kvstore.test_runs import s3_objects


@pytest.fixture(params=["sqlite", "redis"])
def kv(request, make_server):
    extra = request.getfixturevalue("shared_index") if request.param == "redis" else {}
    return make_server(mem_bytes=0, disk_bytes=0, compact_min_age_s=3600, **extra)


def test_mostly_dead_run_is_rewritten_reads_stay_exact_ttl_honoured(kv, clock):
    items = [(hexkey(300 + i), os.urandom(20_000 + i), "agent" if i % 2 else "chatbot")
             for i in range(16)]
    kv.call(kv.core.put_objects(items))
    old = kv.core.meta.get(items[0][0]).run
    keep = [items[1], items[3], items[4]]  # agent, agent, chatbot: 3/16 of the bytes live
    gone = [k for k, _, _ in items if k not in {k for k, _, _ in keep}]
    assert call(kv.address, lambda c: c.delete(gone)) == 13
    call(kv.address, lambda c: c.run_gc())
    assert kv.core.counters["runs_compacted"] == 0  # younger than compact_min_age_s
    clock.advance(7200)
    keys = [k for k, _, _ in keep]
    want = [d for _, d, _ in keep]
    stop, seen = threading.Event(), {"reads": 0, "wrong": 0, "miss": 0}

    def reader():
        while not stop.is_set():
            got = call(kv.address, lambda c: c.get(keys))
            seen["reads"] += 1
            seen["wrong"] += sum(g is not None and g != w for g, w in zip(got, want, strict=True))
            seen["miss"] += sum(g is None for g in got)

    t = threading.Thread(target=reader)
    t.start()
    try:
        call(kv.address, lambda c: c.run_gc())
    finally:
        stop.set()
        t.join(30)
    assert seen["wrong"] == 0 and seen["miss"] == 0 and seen["reads"] > 0, seen
    assert kv.core.counters["runs_compacted"] == 1
    assert kv.core.counters["compaction_blocks_moved"] == 3
    new = kv.core.meta.get(keys[0]).run
    assert new != old and {kv.core.meta.get(k).run for k in keys} == {new}
    assert [kv.core.meta.get(k).traffic_class for k in keys] == ["agent", "agent", "chatbot"]
    call(kv.address, lambda c: c.run_gc())  # the old run, if a racing read held it then
    assert s3_objects(kv, RUN_PREFIX) == [[new]] * 12 and list(kv.core.meta.runs) == [new]
    assert call(kv.address, lambda c: c.get(keys)) == want
    # TTL classes after the move: 3.5 days on, the agent blocks expire, the chatbot one
    # stays; 7+ days after its last read it goes too, and the new run with it.
    clock.advance(3.5 * DAY)
    rep = call(kv.address, lambda c: c.run_gc())
    assert sorted(rep.expired) == sorted(keys[:2])
    assert call(kv.address, lambda c: c.get(keys)) == [None, None, want[2]]
    assert kv.core.counters["runs_compacted"] == 1  # 1 block of 1 is not mostly dead
    clock.advance(7.5 * DAY)
    assert list(call(kv.address, lambda c: c.run_gc()).expired) == [keys[2]]
    assert s3_objects(kv, RUN_PREFIX) == [[]] * 12 and list(kv.core.meta.runs) == []


def test_a_delete_racing_compaction_wins(kv, clock):
    """A block deleted after compaction read it is not moved (relocate checks the
    record): it stays deleted, and the new run holds only the others."""
    items = [(hexkey(600 + i), os.urandom(10_000)) for i in range(8)]
    call(kv.address, lambda c: c.put(items))
    old = kv.core.meta.get(items[0][0]).run
    call(kv.address, lambda c: c.delete([k for k, _ in items[1:7]]))  # 2 of 8 live
    clock.advance(7200)
    moves = [(k, kv.core.meta.get(k)) for k in (items[0][0], items[7][0])]
    call(kv.address, lambda c: c.delete([items[7][0]]))  # after the snapshot
    info = kv.core.meta.runs[old]
    assert kv.core.meta.relocate(old, "f" * 32, info, [(k, r, 0) for k, r in moves]) == 1
    assert kv.core.meta.get(items[7][0]) is None and kv.core.meta.get(items[0][0]).run == "f" * 32
