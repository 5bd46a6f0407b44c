"""Part 3 of bench/kvstore/throughput.py: runs vs per-block objects vs raw boto3.

    python -m bench.kvstore.throughput --only runs [--prefixes 32] [--block-kib 256]

Each prefix is 16 blocks, put in one call (one run, or 16 objects with
`run_blocks=1`) and read back as one 16-key Get at concurrency 16; the raw row
GETs the same 16 blocks' bytes stored as ONE object. Every kvstore has its
hot tiers off, so every get is the S3 path. Request counts are the kvstores'
own (Stats counters `s3_requests_*`, every S3 request they sent).

Also in the same run: the floor of any 10-data-shard layout on this machine (each
prefix's bytes as 10 raw objects of a tenth each, read with 10 parallel boto3 GETs:
no kvstore, no gRPC), and runs on the shared index (a Valkey started here): one
kvstore process, and two kvstore processes behind the client pool (`--kvstore a,b`).
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import OUT
from bench.kvstore.clients import CpuMeter, raw_clients, start_kvstore, timed
from kvmesh.launch.backing.seaweed import start_seaweed_cluster
from kvmesh.launch.backing.valkey import ValkeyProcess
from kvmesh.services.kvstore.client import KvstoreClient, KvstorePool, connect

BLOCKS = 16
CONCURRENCY = 16
SINGLE_READS = 16


def _key(tag: str, p: int, b: int) -> str:
    return f"{tag}{p:05d}{b:03d}".ljust(64, "0")


async def _requests(c: KvstoreClient | KvstorePool) -> dict[str, int]:
    out: dict[str, int] = {}
    for one in (c.clients if isinstance(c, KvstorePool) else [c]):  # a pool: all replicas
        for k, v in (await one.stats()).counters.items():
            if k.startswith("s3_requests_"):
                out[k[len("s3_requests_"):]] = out.get(k[len("s3_requests_"):], 0) + v
    return out


def _delta(after: dict[str, int], before: dict[str, int], kinds: tuple[str, ...]) -> int:
    return sum(after.get(k, 0) - before.get(k, 0) for k in kinds)


async def _service(address: str, tag: str, prefixes: list[list[bytes]], meter: CpuMeter) -> dict:
    n = len(prefixes)
    async with connect(address, timeout=300) as c:
        r0 = await _requests(c)
        t_put = await timed(n, CONCURRENCY, lambda p: c.put(
            [(_key(tag, p, b), prefixes[p][b]) for b in range(BLOCKS)]))
        r1 = await _requests(c)
        got: dict[int, list] = {}

        async def read(p: int) -> None:
            got[p] = await c.get([_key(tag, p, b) for b in range(BLOCKS)])

        meter.start()
        t_get = await timed(n, CONCURRENCY, read)
        cpu = meter.stop(n)
        r2 = await _requests(c)
        rng = random.Random(7)
        for _ in range(SINGLE_READS):
            p, b = rng.randrange(n), rng.randrange(BLOCKS)
            assert (await c.get([_key(tag, p, b)]))[0] == prefixes[p][b], "wrong single block"
        r3 = await _requests(c)
    assert all(got[p] == prefixes[p] for p in range(n)), f"{tag}: wrong bytes"
    reads = ("get", "range")
    return {"put_s": t_put, "get_s": t_get, "cpu": cpu,
            "put_req_per_block": _delta(r1, r0, ("put",)) / (n * BLOCKS),
            "get_req_per_prefix": _delta(r2, r1, reads) / n,
            "single_req": _delta(r3, r2, reads) / SINGLE_READS}


def _raw(cluster, prefixes: list[list[bytes]], meter: CpuMeter) -> tuple[float, dict]:
    bucket = "raw-runs"
    clients = raw_clients(cluster, bucket)
    whole = [b"".join(p) for p in prefixes]

    def put(i: int) -> None:
        clients[i % len(clients)].put_object(Bucket=bucket, Key=f"p{i}", Body=whole[i])

    def get(i: int) -> None:
        body = clients[i % len(clients)].get_object(Bucket=bucket, Key=f"p{i}")["Body"].read()
        assert body == whole[i]

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(put, range(len(whole))))
        meter.start()
        t0 = time.perf_counter()
        list(pool.map(get, range(len(whole))))
        t = time.perf_counter() - t0
        return t, meter.stop(len(whole))


def _floor(cluster, prefixes: list[list[bytes]], meter: CpuMeter) -> tuple[float, dict]:
    """Each prefix as 10 raw objects of a tenth of its bytes, spread over the servers as
    the 12 locations are; a read = 10 parallel GETs. What SeaweedFS alone costs for a
    10-data-shard read of the prefix (no kvstore, no gRPC, no checks)."""
    bucket = "raw-floor"
    clients = raw_clients(cluster, bucket)
    parts = []
    for p in prefixes:
        whole = b"".join(p)
        step = -(-len(whole) // 10)
        parts.append([whole[i * step:(i + 1) * step] for i in range(10)])

    def put(ij: tuple[int, int]) -> None:
        i, j = ij
        clients[j % len(clients)].put_object(Bucket=bucket, Key=f"p{i}/{j}", Body=parts[i][j])

    def get(ij: tuple[int, int]) -> bytes:
        i, j = ij
        return clients[j % len(clients)].get_object(Bucket=bucket, Key=f"p{i}/{j}")["Body"].read()

    with ThreadPoolExecutor(CONCURRENCY * 10) as pool:
        list(pool.map(put, [(i, j) for i in range(len(parts)) for j in range(10)]))
        sem = asyncio.Semaphore(CONCURRENCY)

        async def prefix(i: int) -> None:
            async with sem:
                loop = asyncio.get_running_loop()
                got = await asyncio.gather(*(loop.run_in_executor(pool, get, (i, j))
                                             for j in range(10)))
                assert list(got) == parts[i]

        async def all_prefixes() -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(prefix(i) for i in range(len(parts))))
            return time.perf_counter() - t0

        meter.start()
        t = asyncio.run(all_prefixes())
        return t, meter.stop(len(parts))


def runs_bench(console, n_prefixes: int, block: int) -> list[tuple]:
    from rich.table import Table

    prefixes = [[os.urandom(block) for _ in range(BLOCKS)] for _ in range(n_prefixes)]
    mb = n_prefixes * BLOCKS * block / 1e6
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvruns-") as d:
        tmp = Path(d)
        cluster = start_seaweed_cluster(5, [3, 3, 2, 2, 2], tmp / "seaweed")
        valkey = ValkeyProcess(work_dir=tmp / "valkey").start()
        procs = []
        try:
            runs_kv, runs_addr = start_kvstore(cluster, tmp, "kv-runs", tiers=False)
            blk_kv, blk_addr = start_kvstore(cluster, tmp, "kv-blocks", tiers=False,
                                             run_blocks=1)
            shared = [start_kvstore(cluster, tmp, f"kv-shared-{i}", tiers=False,
                                    index=valkey.url, index_prefix=f"kvmesh:kv:{pre}")
                      for i, pre in ((0, "one"), (1, "two"), (2, "two"))]
            procs = [runs_kv, blk_kv, *(p for p, _ in shared)]
            weed = [s.proc.proc.pid for s in cluster.servers]
            me = [os.getpid()]
            console.print(f"[dim]runs: {n_prefixes} prefixes x {BLOCKS} x {block >> 10} KiB, "
                          f"concurrency {CONCURRENCY}: raw, runs, per-block objects...[/]")
            t_raw, c_raw = _raw(cluster, prefixes, CpuMeter({"weed": weed, "kvstore": [],
                                                              "bench": me}))
            results["raw boto3 GET (one object)"] = {"get_s": t_raw, "cpu": c_raw}
            t_fl, c_fl = _floor(cluster, prefixes, CpuMeter({"weed": weed, "kvstore": [],
                                                             "bench": me}))
            results["floor: 10 raw GETs of 1/10"] = {"get_s": t_fl, "cpu": c_fl}
            two = f"{shared[1][1]},{shared[2][1]}"
            for name, addr, pids, tag in (
                    ("runs (16 blocks)", runs_addr, [runs_kv], "a"),
                    ("per-block objects", blk_addr, [blk_kv], "b"),
                    ("runs, shared index, 1 kvstore", shared[0][1], [shared[0][0]], "c"),
                    ("runs, shared index, 2 kvstores", two, [p for p, _ in shared[1:]], "d")):
                meter = CpuMeter({"weed": weed, "kvstore": [p.proc.pid for p in pids],
                                  "bench": me})
                results[name] = asyncio.run(_service(addr, tag, prefixes, meter))
        finally:
            for p in procs:
                p.stop()
            valkey.close()
            cluster.stop()
    t = Table(title=f"runs: {n_prefixes} prefixes of {BLOCKS} x {block >> 10} KiB, "
                    f"concurrency {CONCURRENCY}, hot tiers off")
    for col in ("path", "put MB/s", "prefix read MB/s", "vs raw GET", "S3 req / stored block",
                "S3 req / 16-block read", "S3 req / 1-block read", "CPU ms / prefix (weed, "
                "kvstore, bench)"):
        t.add_column(col, justify="right")
    rows = []
    for name, r in results.items():
        cpu = r["cpu"]
        ratio = t_raw / r["get_s"]
        rows.append((name, mb / r["get_s"], ratio))
        svc = "put_s" in r
        t.add_row(name, f"{mb / r['put_s']:.0f}" if svc else "", f"{mb / r['get_s']:.0f}",
                  f"{ratio:.2f}x", f"{r['put_req_per_block']:.2f}" if svc else (
                      "1 object" if name.startswith("raw") else "10 objects"),
                  f"{r['get_req_per_prefix']:.1f}" if svc else (
                      "1" if name.startswith("raw") else "10"),
                  f"{r['single_req']:.2f}" if svc else "",
                  f"{cpu['weed']:.0f}, {cpu['kvstore']:.0f}, {cpu['bench']:.0f}")
    console.print(t)
    _plot(rows)
    return rows


def _plot(rows: list[tuple]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar([r[0] for r in rows], [r[1] for r in rows],
           color=["grey", "silver", "tab:blue", "tab:orange", "tab:green", "tab:olive"])
    for i, r in enumerate(rows):
        ax.text(i, r[1], f"{r[2]:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("MB/s (16-block prefix reads, concurrency 16)")
    ax.set_title("kvstore runs vs per-block objects vs raw GET")
    ax.tick_params(axis="x", labelsize=7, labelrotation=15)
    fig.tight_layout()
    fig.savefig(OUT / "kvstore_runs.png", dpi=100)
    print(f"wrote {OUT / 'kvstore_runs.png'}")
