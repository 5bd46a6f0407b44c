"""Shard locations really going away (weed processes killed) and bit rot on S3."""

import os
import subprocess
import sys

import pytest

from kvmesh.services.kvstore.shards import PREFIX
from tests.kvstore.conftest import (
    THREE_LOCATION_SERVER,
    TWO_LOCATION_SERVER,
    call,
    hexkey,
)

SIZES = [0, 1, 11, 100_003, 2 * 1024 * 1024 + 5]


@pytest.fixture
def stored(make_server):
    """A kvstore without hot tiers, so every read goes to the shards; one object per
    block (run_blocks=1: test_runs.py covers the same faults for runs)."""
    kv = make_server(mem_bytes=0, disk_bytes=0, run_blocks=1)
    items = [(hexkey(500 + i), os.urandom(n)) for i, n in enumerate(SIZES)]
    call(kv.address, lambda c: c.put(items))
    return kv, items


def test_two_locations_down_every_read_succeeds(stored, killer):
    kv, items = stored
    assert len(killer(TWO_LOCATION_SERVER)) == 2
    got = call(kv.address, lambda c: c.get([k for k, _ in items]))
    assert got == [d for _, d in items]
    assert call(kv.address, lambda c: c.lookup([k for k, _ in items])) == len(items)


def test_three_locations_down_is_a_clean_miss(stored, killer):
    kv, items = stored
    assert len(killer(THREE_LOCATION_SERVER)) == 3
    got = call(kv.address, lambda c: c.get([k for k, _ in items]))
    assert got == [None] * len(items)


def test_put_with_two_locations_down_fails_below_write_quorum(stored, killer):
    kv, _ = stored
    killer(TWO_LOCATION_SERVER)
    import grpc

    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(kv.address, lambda c: c.put([(hexkey(999), b"data")]))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert call(kv.address, lambda c: c.get([hexkey(999)])) == [None]


def corrupt(kv, index: int, key: str) -> None:
    """Flip bytes of one stored shard directly on S3, behind the kvstore's back."""
    loc = kv.core.cfg.locations[index]
    client = kv.core.shards._clients[index]
    body = bytearray(client.get_object(Bucket=loc.bucket, Key=PREFIX + key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=loc.bucket, Key=PREFIX + key, Body=bytes(body))


def test_corrupt_shards_detected_read_still_exact_and_repaired_on_read(stored):
    kv, items = stored
    key, data = items[3]
    corrupt(kv, 1, key)
    corrupt(kv, 8, key)
    assert call(kv.address, lambda c: c.get([key])) == [data]
    assert kv.core.counters["shards_repaired"] == 2
    report = call(kv.address, lambda c: c.scrub(repair=False))
    assert (report.objects, report.healthy, report.shards_bad) == (len(items), len(items), 0)


def test_bitrot_found_by_scrub_and_repaired_by_cli(stored, tmp_path):
    kv, items = stored
    key, data = items[4]
    corrupt(kv, 0, key)
    corrupt(kv, 11, key)
    report = call(kv.address, lambda c: c.scrub(repair=False))
    # (once, under the whole suite, the two smallest objects read as lost: say whether their
    # shard reads timed out, failed or came back bad)
    assert list(report.degraded) == [key] and report.shards_bad == 2, (
        f"{report}; counters {dict(kv.core.counters)}; errors a location "
        f"{[kv.core.shards.error_rate(i)[0] for i in range(12)]}")
    assert report.shards_repaired == 0
    cli = subprocess.run(
        [sys.executable, "-m", "kvmesh.launch.cli", "admin", "--kvstore", kv.address, "scrub", "--repair"],
        capture_output=True, text=True, timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    assert "repaired" in cli.stdout and "2" in cli.stdout
    report = call(kv.address, lambda c: c.scrub(repair=False))
    assert (report.healthy, report.shards_bad, list(report.degraded)) == (len(items), 0, [])
    # The repaired shards are the original bytes again, checked straight on S3.
    from kvmesh.services.kvstore import ec

    for i in (0, 11):
        blob = kv.call(kv.core.shards.get(i, key))
        head, _ = ec.parse(kv.core.cfg.layout, blob, key=key, index=i)
        assert head.object_size == len(data)
    assert call(kv.address, lambda c: c.get([key])) == [data]
