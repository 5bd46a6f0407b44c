"""One Get of a long prefix (80 runs of 16 blocks) is served whole, with its S3 reads
bounded: without the bound every run read started at once, the queued shard GETs passed
their late deadline and turned into hedged full decodes, and under load some blocks came
back as misses with all 12 locations up (seen in the two-replica load test)."""

from __future__ import annotations

import hashlib

from tests.kvstore.conftest import call, hexkey

BLOCKS, SIZE, IN_FLIGHT = 1280, 20_000, 8


def test_a_prefetch_of_eighty_runs_is_exact_with_bounded_reads(make_server):
    kv = make_server(mem_bytes=0, disk_bytes=0, s3_reads_in_flight=IN_FLIGHT)
    items = [(hexkey(i), hashlib.blake2b(str(i).encode()).digest() * (SIZE // 64))
             for i in range(BLOCKS)]
    for j in range(0, BLOCKS, 16):
        call(kv.address, lambda c, b=items[j:j + 16]: c.put(b))
    assert kv.core.counters["runs_written"] == BLOCKS // 16

    reader, now, peak = kv.core.runs, [0], [0]
    plain = reader.read

    async def counted(*args, **kw):
        now[0] += 1
        peak[0] = max(peak[0], now[0])
        try:
            return await plain(*args, **kw)
        finally:
            now[0] -= 1

    reader.read = counted
    got = call(kv.address, lambda c: c.get([k for k, _ in items]), timeout=120)
    assert [g == d for g, (_, d) in zip(got, items, strict=True)] == [True] * BLOCKS
    assert kv.core.counters["run_reads"] == BLOCKS // 16
    assert peak[0] == IN_FLIGHT  # the bound held, and was reached (80 runs wanted)
