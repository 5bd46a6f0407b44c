"""End-to-end integrity: shards rewritten with a *valid* crc32 (a buggy writer, or
anyone with write access to a bucket) must never come back as wrong bytes.

Every object's blake3 digest is recorded at put time; the reassembled bytes are
checked against it. A mismatch is treated like lost shards: other shard sets
(parity) are tried, else the get is a clean miss. Real SeaweedFS, real gRPC.
"""

import os
import sqlite3
import struct
import zlib

from kvmesh.services.kvstore import ec
from kvmesh.services.kvstore.meta import MetaStore
from kvmesh.services.kvstore.shards import PREFIX
from tests.kvstore.conftest import call, hexkey


def s3_shard(kv, index: int, key: str) -> bytes:
    loc = kv.core.cfg.locations[index]
    client = kv.core.shards._clients[index]
    return client.get_object(Bucket=loc.bucket, Key=PREFIX + key)["Body"].read()


def write_shard(kv, index: int, key: str, blob: bytes) -> None:
    loc = kv.core.cfg.locations[index]
    kv.core.shards._clients[index].put_object(Bucket=loc.bucket, Key=PREFIX + key, Body=blob)


def forge_flip(blob: bytes) -> bytes:
    """Flip payload bytes and recompute the crc32 trailer: passes every shard check."""
    bad = bytearray(blob)
    for pos in range(len(bad) // 2, len(bad) // 2 + 16):
        bad[pos] ^= 0x5A
    struct.pack_into("<I", bad, len(bad) - 4, zlib.crc32(bytes(bad[:-4])))
    return bytes(bad)


def forge_other_object(kv, index: int, key: str, size: int) -> bytes:
    """A complete, self-consistent shard of *another* object under the same key,
    index and generation: header, fragment header and crc all valid."""
    gen = kv.core.meta.current(key).generation
    return ec.encode(kv.core.cfg.layout, key, gen, os.urandom(size))[index]


def stored(make_server, sizes):
    # every get reassembles from S3; one object per block (test_runs.py: forged run shards)
    kv = make_server(mem_bytes=0, disk_bytes=0, run_blocks=1)
    items = [(hexkey(700 + i), os.urandom(n)) for i, n in enumerate(sizes)]
    call(kv.address, lambda c: c.put(items))
    return kv, items


def test_forged_data_shard_read_exact_from_parity_counted_and_repaired(make_server):
    kv, items = stored(make_server, [100_003, 300_001])
    (k1, d1), (k2, d2) = items
    originals = {i: s3_shard(kv, i, k1) for i in (4,)}
    # The forged shards pass ec.parse: only the digest can tell.
    write_shard(kv, 4, k1, forge_flip(originals[4]))
    ec.parse(kv.core.cfg.layout, s3_shard(kv, 4, k1), key=k1, index=4)
    write_shard(kv, 0, k2, forge_other_object(kv, 0, k2, len(d2)))
    assert call(kv.address, lambda c: c.get([k1, k2])) == [d1, d2]
    assert kv.core.counters["digest_mismatches_recovered"] == 2
    assert kv.core.counters["shards_forged"] == 2
    assert kv.core.counters["digest_mismatches_unrecovered"] == 0
    # The forged shards were rewritten with the original bytes.
    assert s3_shard(kv, 4, k1) == originals[4]
    report = call(kv.address, lambda c: c.scrub(repair=False))
    assert (report.healthy, report.shards_bad) == (2, 0)


def test_forged_parity_shard_found_by_scrub_and_repaired(make_server):
    kv, items = stored(make_server, [50_000])
    key, data = items[0]
    original = s3_shard(kv, 11, key)
    write_shard(kv, 11, key, forge_flip(original))
    # A get does not need parity: exact bytes, nothing noticed.
    assert call(kv.address, lambda c: c.get([key])) == [data]
    report = call(kv.address, lambda c: c.scrub(repair=False))
    assert (list(report.degraded), report.shards_bad) == ([key], 1)
    report = call(kv.address, lambda c: c.scrub(repair=True))
    assert report.shards_repaired == 1
    assert s3_shard(kv, 11, key) == original


def test_more_forged_shards_than_parity_is_a_clean_miss_never_wrong_bytes(make_server):
    kv, items = stored(make_server, [20_000, 40_000])
    (k1, _), (k2, d2) = items
    for i in (1, 5, 10):  # three forged shards: no 10 consistent shards remain
        write_shard(kv, i, k1, forge_flip(s3_shard(kv, i, k1)))
    assert call(kv.address, lambda c: c.get([k1, k2])) == [None, d2]
    assert kv.core.counters["digest_mismatches_unrecovered"] == 1
    assert kv.core.counters["misses"] == 1
    report = call(kv.address, lambda c: c.scrub(repair=True))
    assert list(report.lost) == [k1] and report.shards_repaired == 0


def test_whole_object_replaced_consistently_is_a_miss(make_server):
    """Every shard rewritten from another object (same key, generation, sizes):
    the shards agree with each other, only the recorded digest disagrees."""
    kv, items = stored(make_server, [64_000])
    key, data = items[0]
    gen = kv.core.meta.current(key).generation
    for i, blob in enumerate(ec.encode(kv.core.cfg.layout, key, gen, os.urandom(len(data)))):
        write_shard(kv, i, key, blob)
    assert call(kv.address, lambda c: c.get([key])) == [None]


def test_digest_recorded_and_kept_across_restarts(tmp_path):
    db = tmp_path / "meta.sqlite"
    meta = MetaStore(db, now=1.0)
    meta.begin_put("aa" * 16, 7, 3, "agent", 1.0, ec.digest(b"abc"))
    meta.commit_put("aa" * 16, 7)
    meta.close()
    again = MetaStore(db, now=2.0)
    assert again.current("aa" * 16).digest == ec.digest(b"abc") == bytes.fromhex(
        "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85")
    again.close()


def test_database_from_before_digests_is_migrated(tmp_path):
    db = tmp_path / "old.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE objects (key TEXT PRIMARY KEY, generation INTEGER NOT NULL,"
                " size INTEGER NOT NULL, traffic_class TEXT NOT NULL, created REAL NOT NULL,"
                " last_access REAL NOT NULL, complete INTEGER NOT NULL)")
    con.execute("INSERT INTO objects VALUES ('bb', 3, 10, 'chatbot', 1.0, 1.0, 1)")
    con.commit()
    con.close()
    meta = MetaStore(db, now=5.0)
    assert meta.current("bb").digest is None  # served unchecked, as before
    meta.begin_put("cc", 4, 2, "agent", 5.0, b"\x01" * 32)
    meta.close()
    assert MetaStore(db, now=6.0).get("cc").digest == b"\x01" * 32
