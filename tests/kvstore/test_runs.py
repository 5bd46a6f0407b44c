"""Runs: a batch of blocks stored as ONE erasure-coded object per location (runs.py).

Requests are counted by the kvstore's own S3 client (`ShardStore.requests`, every
request it sends), the same numbers Stats shows as `s3_requests_*`.
"""

import os
from collections import Counter

import pytest

from kvmesh.services.kvstore import ec, runs
from kvmesh.services.kvstore.config import DAY
from kvmesh.services.kvstore.shards import RUN_PREFIX
from tests.kvstore.conftest import THREE_LOCATION_SERVER, TWO_LOCATION_SERVER, call, hexkey

# 16 blocks of about one engine block's size each (the last odd-sized): every block
# is shorter than the 1.6-block fragment, so it lies in at most two data shards.
SIZES = [40_000 + 17 * i for i in range(15)] + [12_345]


def store_run(kv, base: int, sizes=SIZES, traffic_class="agent"):
    items = [(hexkey(base + i), os.urandom(n)) for i, n in enumerate(sizes)]
    call(kv.address, lambda c: c.put(items, traffic_class=traffic_class))
    return items


@pytest.fixture
def run16(make_server):
    kv = make_server(mem_bytes=0, disk_bytes=0)  # every get goes to S3
    return kv, store_run(kv, 700)


def run_of(kv, key: str) -> str:
    return kv.core.meta.get(key).run


def s3_objects(kv, prefix: str) -> list[list[str]]:
    return [[s.key for s in kv.call(kv.core.shards.list(i, prefix))] for i in range(12)]


def counted(kv, fn):
    """(result, S3 requests sent by the kvstore while fn ran, by kind, less the full GETs
    of a decode that a late ranged GET started: on this shared 2-core box a read is
    now and then later than the fast path waits, and the hedge is then right)."""
    before = Counter(kv.core.shards.requests)
    late = kv.core.counters["run_ranged_late"]
    out = fn()
    sent = Counter(kv.core.shards.requests) - before
    if kv.core.counters["run_ranged_late"] > late:
        sent.pop("get", None)
    return out, sent


def test_sixteen_blocks_are_one_run_of_twelve_objects_and_twelve_puts(run16):
    kv, items = run16
    run = run_of(kv, items[0][0])
    assert {run_of(kv, k) for k, _ in items} == {run} and len(run) == runs.RUN_ID_HEX
    assert kv.core.shards.requests["put"] == 12  # 0.75 requests per stored block
    assert s3_objects(kv, RUN_PREFIX) == [[run]] * 12
    assert s3_objects(kv, "blk/") == [[]] * 12
    offsets = [kv.core.meta.get(k).offset for k, _ in items]
    assert offsets == runs.layout_blocks(SIZES)


def test_single_block_read_is_one_or_two_ranged_gets(run16):
    kv, items = run16
    for key, data in items:
        got, sent = counted(kv, lambda key=key: call(kv.address, lambda c: c.get([key])))
        assert got == [data]
        assert sent["get"] == 0 and 1 <= sent["range"] <= 2, (key, sent)
    late = kv.core.counters["run_ranged_late"]
    assert kv.core.counters["run_reads_decoded"] <= late  # decoded only after a late GET


def test_whole_run_read_is_ten_gets(run16):
    kv, items = run16
    got, sent = counted(kv, lambda: call(kv.address, lambda c: c.get([k for k, _ in items])))
    assert got == [d for _, d in items]
    assert sent == Counter(range=10)


def test_two_locations_down_every_block_exact(run16, killer):
    kv, items = run16
    assert len(killer(TWO_LOCATION_SERVER)) == 2
    assert call(kv.address, lambda c: c.get([k for k, _ in items])) == [d for _, d in items]
    for key, data in items:  # single-block reads: ranged where possible, else decoded
        assert call(kv.address, lambda c, key=key: c.get([key])) == [data]


def test_three_locations_down_is_a_clean_miss(run16, killer):
    """Below k the run cannot be decoded: every block that needs a lost data shard is a
    clean miss; a block whose data shards all survive is still served, exact (its bytes
    are checked against its digest), never wrong bytes."""
    kv, items = run16
    dead = set(killer(THREE_LOCATION_SERVER))
    assert len(dead) == 3
    info = kv.core.meta.runs[run_of(kv, items[0][0])]

    def needs_dead(key: str) -> bool:
        rec = kv.core.meta.get(key)
        return any(s.shard in dead for s in runs.locate(rec.offset, rec.size, info.frag_data, 10))

    want = [None if needs_dead(k) else d for k, d in items]
    assert sum(w is None for w in want) >= 5 and any(w is not None for w in want)
    assert call(kv.address, lambda c: c.get([k for k, _ in items])) == want
    for (key, _), expect in zip(items, want, strict=True):
        assert call(kv.address, lambda c, key=key: c.get([key])) == [expect]


def flip(kv, index: int, run: str, at: int) -> None:
    """Flip one byte of a run's shard object directly on S3."""
    loc, client = kv.core.cfg.locations[index], kv.core.shards._clients[index]
    name = RUN_PREFIX + run
    body = bytearray(client.get_object(Bucket=loc.bucket, Key=name)["Body"].read())
    body[at] ^= 0xFF
    client.put_object(Bucket=loc.bucket, Key=name, Body=bytes(body))


def test_bitrot_in_a_block_read_exact_then_repaired(run16):
    kv, items = run16
    key, data = items[0]
    run = run_of(kv, key)
    flip(kv, 0, run, kv.core.meta.runs[run].data_at + 5)  # inside block 0
    counters = kv.core.counters
    assert call(kv.address, lambda c: c.get([key])) == [data]
    assert counters["run_reads_decoded"] == 1  # the ranged read failed its digest
    assert counters["shards_repaired"] == 1
    decoded, late = counters["run_reads_decoded"], counters["run_ranged_late"]
    assert call(kv.address, lambda c: c.get([key])) == [data]
    # repaired: ranged again (a decode now only if a ranged GET was late, see `counted`)
    assert counters["run_reads_decoded"] - decoded <= counters["run_ranged_late"] - late


def test_bitrot_found_by_scrub_and_repaired(run16):
    kv, items = run16
    run = run_of(kv, items[0][0])
    flip(kv, 11, run, kv.core.meta.runs[run].data_at + 1000)  # parity: no get reads it
    report = call(kv.address, lambda c: c.scrub(repair=False))
    assert (list(report.degraded), report.shards_bad) == ([RUN_PREFIX + run], 1)
    report = call(kv.address, lambda c: c.scrub(repair=True))
    assert report.shards_repaired == 1
    report = call(kv.address, lambda c: c.scrub(repair=False))
    assert (report.healthy, report.shards_bad) == (1, 0)
    assert call(kv.address, lambda c: c.get([k for k, _ in items])) == [d for _, d in items]


def test_ttl_per_block_run_reclaimed_with_its_last_block(make_server, clock):
    kv = make_server(mem_bytes=0, disk_bytes=0)
    items = store_run(kv, 800, [1000 + i for i in range(4)], traffic_class="agent")
    run = run_of(kv, items[0][0])
    clock.advance(2 * DAY)
    call(kv.address, lambda c: c.get([items[0][0], items[1][0]]))  # refresh two blocks
    clock.advance(1.5 * DAY)
    report = call(kv.address, lambda c: c.run_gc())
    assert sorted(report.expired) == [items[2][0], items[3][0]]
    assert s3_objects(kv, RUN_PREFIX) == [[run]] * 12  # two live blocks keep the run
    assert call(kv.address, lambda c: c.get([k for k, _ in items])) == \
        [items[0][1], items[1][1], None, None]
    clock.advance(3.5 * DAY)
    report = call(kv.address, lambda c: c.run_gc())
    assert sorted(report.expired) == [items[0][0], items[1][0]]
    assert s3_objects(kv, RUN_PREFIX) == [[]] * 12 and run not in kv.core.meta.runs
    assert kv.core.counters["runs_reclaimed"] == 1


def test_overwrite_and_delete_reclaim_runs(make_server):
    kv = make_server(mem_bytes=0, disk_bytes=0)
    old = store_run(kv, 900, [5000] * 3)
    first = run_of(kv, old[0][0])
    new = store_run(kv, 900, [7000] * 3)
    second = run_of(kv, new[0][0])
    assert first != second and first not in kv.core.meta.runs
    assert s3_objects(kv, RUN_PREFIX) == [[second]] * 12
    assert call(kv.address, lambda c: c.get([k for k, _ in new])) == [d for _, d in new]
    assert call(kv.address, lambda c: c.delete([new[0][0], new[1][0]])) == 2
    assert s3_objects(kv, RUN_PREFIX) == [[second]] * 12
    assert call(kv.address, lambda c: c.delete([new[2][0]])) == 1
    assert s3_objects(kv, RUN_PREFIX) == [[]] * 12


def test_run_blocks_caps_the_run_and_empty_blocks_stand_alone(make_server):
    kv = make_server(mem_bytes=0, disk_bytes=0, run_blocks=4)
    items = store_run(kv, 950, [100] * 10 + [0])
    assert len({run_of(kv, k) for k, _ in items[:10]}) == 3  # 4 + 4 + 2
    assert run_of(kv, items[10][0]) == ""
    assert call(kv.address, lambda c: c.get([k for k, _ in items])) == [d for _, d in items]


def test_format_1_objects_stay_readable(make_server):
    kv = make_server(mem_bytes=0, disk_bytes=0)
    key, data = hexkey(990), os.urandom(70_001)
    call(kv.address, lambda c: c.put([(key, data)]))
    gen = kv.core.meta.get(key).generation
    old = ec.encode(kv.core.cfg.layout, key, gen, data)  # no manifest: format 1
    assert ec.parse(kv.core.cfg.layout, old[0])[0].version == ec.FORMAT_V1
    for i, blob in enumerate(old):
        assert kv.call(kv.core.shards.put(i, key, blob))
    assert call(kv.address, lambda c: c.get([key])) == [data]
