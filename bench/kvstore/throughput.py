"""kvstore throughput: erasure coding speed and end-to-end put/get through the service.

    python -m bench.kvstore.throughput [--size-mib 4] [--objects 32]

Part 1, codec (CPU only): encode/decode GB/s of 10+2 with pyeclib ISA-L and with
zfec, against a plain memory copy of the same bytes. Decode is measured with the
two first data shards lost (the repair path, not a plain concatenation).

Part 2, end to end (real processes): five SeaweedFS servers, the kvstore as a
`kvmesh kvstore serve` subprocess, an async client. Service put/get MB/s versus
raw boto3 PUT/GET of the same unencoded bytes to the same SeaweedFS servers, at
concurrency 1 and 16. "get (S3 path)" runs against a kvstore with both hot tiers
off, so every get fetches the 10 data shards and checks them; "get (memory
tier)" is the hot path. "durable read in-process" is the reference floor of the
S3 path: the kvstore's own read code (`DurableStore.get`: 10 presigned shard
GETs, checksums, assembly) run inside the benchmark process, so no kvstore
process and no gRPC hop; no service built on 10+2 shards can read faster than
that on the same machine.

For every get row the CPU time spent per object by the weed servers, the
kvstore process and the benchmark process itself is read from /proc: on a
2-core box the rows are CPU-bound, so these columns say where the time goes.
Part 3, runs (services/kvstore/runs.py): prefixes of 16 blocks (an engine's
write-through batch), each put in one call, read back as one 16-key Get (what
an engine's prefetch does) at concurrency 16, from a kvstore storing runs
(the default) and one storing every block as its own object (`run_blocks=1`),
both with hot tiers off, against one raw boto3 GET of the same bytes stored as
a single object. S3 requests are the kvstore's own counts (Stats counters
`s3_requests_*`): per stored block, per 16-block read, per single-block read.

Prints the tables and writes bench/out/kvstore_throughput.png and
bench/out/kvstore_runs.png.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import OUT, parser
from bench.kvstore.clients import CpuMeter, raw_clients, start_kvstore, timed
from bench.kvstore.runs import runs_bench
from kvmesh.launch.backing.seaweed import start_seaweed_cluster
from kvmesh.services.kvstore.client import KvstoreClient
from kvmesh.services.kvstore.config import KvstoreConfig, ShardLocation
from kvmesh.services.kvstore.durable import DurableStore
from kvmesh.services.kvstore.shards import ShardStore


def best_of(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def codec_bench(size: int) -> list[tuple[str, float, float]]:
    from pyeclib.ec_iface import ECDriver
    from zfec import easyfec

    data = os.urandom(size)
    gb = size / 1e9
    rows = []
    copy = best_of(lambda: bytearray(data))
    rows.append(("memory copy", gb / copy, gb / copy))
    drv = ECDriver(k=10, m=2, ec_type="isa_l_rs_vand")
    frags = drv.encode(data)
    rows.append(("pyeclib isa_l_rs_vand", gb / best_of(lambda: drv.encode(data)),
                 gb / best_of(lambda: drv.decode(frags[2:]))))
    enc, dec = easyfec.Encoder(10, 12), easyfec.Decoder(10, 12)
    blocks = enc.encode(data)
    pad = (10 - size % 10) % 10
    rows.append(("zfec", gb / best_of(lambda: enc.encode(data)),
                 gb / best_of(lambda: dec.decode(blocks[2:], list(range(2, 12)), pad))))
    return rows


def bench_keys(tag: str, conc: int, n: int) -> list[str]:
    return [f"{tag}{conc:02d}{i:06d}".ljust(64, "0") for i in range(n)]


async def service_bench(address: str, payloads: list[bytes], conc: int, tag: str,
                        meter: CpuMeter):
    keys = bench_keys(tag, conc, len(payloads))
    async with KvstoreClient(address, timeout=300) as c:
        t_put = await timed(len(keys), conc, lambda i: c.put([(keys[i], payloads[i])]))
        got: dict[int, bytes | None] = {}

        async def get(i):
            got[i] = (await c.get([keys[i]]))[0]

        meter.start()
        t_get = await timed(len(keys), conc, get)
        cpu = meter.stop(len(keys))
    assert all(got[i] == payloads[i] for i in range(len(keys))), "service returned wrong bytes"
    return t_put, t_get, cpu


async def inprocess_bench(locations, payloads: list[bytes], conc: int, tag: str,
                          meter: CpuMeter):
    """Read objects the service stored, with its durable-tier code in this process."""
    keys = bench_keys(tag, conc, len(payloads))
    cfg = KvstoreConfig(locations=tuple(ShardLocation.parse(loc) for loc in locations))
    durable = DurableStore(cfg.layout, ShardStore.from_config(cfg), cfg.write_quorum)
    got: dict[int, bytes | None] = {}

    async def get(i):
        got[i] = (await durable.get(keys[i], None, repair=False)).data

    try:
        meter.start()
        t_get = await timed(len(keys), conc, get)
        cpu = meter.stop(len(keys))
    finally:
        await durable.shards.close()
    assert all(got[i] == payloads[i] for i in range(len(keys))), "in-process read: wrong bytes"
    return t_get, cpu


def raw_bench(cluster, payloads: list[bytes], conc: int, meter: CpuMeter):
    bucket = "raw-bench"
    clients = raw_clients(cluster, bucket)
    n = len(clients)

    def put(i):
        clients[i % n].put_object(Bucket=bucket, Key=f"c{conc}/{i}", Body=payloads[i])

    def get(i):
        body = clients[i % n].get_object(Bucket=bucket, Key=f"c{conc}/{i}")["Body"].read()
        assert body == payloads[i]

    with ThreadPoolExecutor(conc) as pool:
        t0 = time.perf_counter()
        list(pool.map(put, range(len(payloads))))
        t_put = time.perf_counter() - t0
        meter.start()
        t0 = time.perf_counter()
        list(pool.map(get, range(len(payloads))))
        t_get = time.perf_counter() - t0
        cpu = meter.stop(len(payloads))
    return t_put, t_get, cpu


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=float, default=4.0)
    ap.add_argument("--objects", type=int, default=32)
    ap.add_argument("--codec-mib", type=int, default=64)
    ap.add_argument("--only", choices=("all", "runs"), default="all",
                    help="runs: only part 3 (runs vs per-block objects vs raw)")
    ap.add_argument("--prefixes", type=int, default=32, help="part 3: 16-block prefixes")
    ap.add_argument("--block-kib", type=int, default=256, help="part 3: block size")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)

    if args.only == "runs":
        runs_bench(console, args.prefixes, args.block_kib << 10)
        return
    codec = codec_bench(args.codec_mib << 20)
    t = Table(title=f"erasure coding 10+2, {args.codec_mib} MiB object (GB/s, best of 3)")
    for col in ("codec", "encode", "decode (2 lost)", "encode vs copy"):
        t.add_column(col, justify="right")
    for name, e, d in codec:
        t.add_row(name, f"{e:.2f}", f"{d:.2f}", f"{e / codec[0][1]:.2f}x")
    console.print(t)

    size = int(args.size_mib * (1 << 20))
    payloads = [os.urandom(size) for _ in range(args.objects)]
    mb = size * args.objects / 1e6
    rows, costs = [], []
    with tempfile.TemporaryDirectory(prefix="kvbench-") as d:
        tmp = Path(d)
        cluster = start_seaweed_cluster(5, [3, 3, 2, 2, 2], tmp / "seaweed")
        procs = []
        try:
            cold, cold_addr = start_kvstore(cluster, tmp, "kv-cold", tiers=False)
            hot, hot_addr = start_kvstore(cluster, tmp, "kv-hot", tiers=True)
            procs = [cold, hot]
            weed = [s.proc.proc.pid for s in cluster.servers]
            me = [os.getpid()]
            for conc in (1, 16):
                console.print(f"[dim]concurrency {conc}: raw boto3, service (S3 path), "
                              "durable read in-process, service (memory tier)...[/]")
                raw_put, raw_get, c_raw = raw_bench(
                    cluster, payloads, conc, CpuMeter({"weed": weed, "kvstore": [],
                                                       "bench": me}))
                s_put, s_get, c_s3 = asyncio.run(service_bench(
                    cold_addr, payloads, conc, "c",
                    CpuMeter({"weed": weed, "kvstore": [cold.proc.pid], "bench": me})))
                i_get, c_in = asyncio.run(inprocess_bench(
                    cluster.locations, payloads, conc, "c",
                    CpuMeter({"weed": weed, "kvstore": [], "bench": me})))
                _, h_get, c_hot = asyncio.run(service_bench(
                    hot_addr, payloads, conc, "d",
                    CpuMeter({"weed": weed, "kvstore": [hot.proc.pid], "bench": me})))
                rows.append((conc, mb / raw_put, mb / raw_get, mb / s_put, mb / s_get,
                             mb / h_get, mb / i_get))
                for name, t, cpu in (("raw boto3 GET", raw_get, c_raw),
                                     ("durable read in-process", i_get, c_in),
                                     ("service get (S3 path)", s_get, c_s3),
                                     ("service get (memory tier)", h_get, c_hot)):
                    costs.append((conc, name, 1e3 * t / args.objects, cpu, raw_get / t))
        finally:
            for p in procs:
                p.stop()
            cluster.stop()
    t = Table(title=f"end to end, {args.objects} x {args.size_mib:g} MiB objects (MB/s)")
    for col in ("concurrency", "raw PUT", "raw GET", "service put", "service get (S3 path)",
                "service get (memory tier)", "durable read in-process", "put / raw",
                "get (S3) / raw", "in-process / raw"):
        t.add_column(col, justify="right")
    for conc, rp, rg, sp, sg, hg, ig in rows:
        t.add_row(str(conc), f"{rp:.0f}", f"{rg:.0f}", f"{sp:.0f}", f"{sg:.0f}", f"{hg:.0f}",
                  f"{ig:.0f}", f"{sp / rp:.2f}x", f"{sg / rg:.2f}x", f"{ig / rg:.2f}x")
    console.print(t)
    t = Table(title="get cost per object (wall ms; CPU ms from /proc, summed per group)")
    for col in ("concurrency", "path", "wall", "CPU weed", "CPU kvstore", "CPU bench client",
                "CPU total", "vs raw GET"):
        t.add_column(col, justify="right")
    for conc, name, wall, cpu, ratio in costs:
        t.add_row(str(conc), name, f"{wall:.1f}", f"{cpu['weed']:.1f}", f"{cpu['kvstore']:.1f}",
                  f"{cpu['bench']:.1f}", f"{sum(cpu.values()):.1f}", f"{ratio:.2f}x")
    console.print(t)
    print_floor(console, costs)
    plot(codec, rows)
    runs_bench(console, args.prefixes, args.block_kib << 10)


def print_floor(console, costs) -> None:
    """What the measured costs allow at the highest concurrency: with every core busy,
    throughput ~ cores / CPU per object, so 0.5x raw leaves twice raw's CPU per object.
    The S3 path cannot spend less than weed's shard GETs plus one gRPC hop (the
    memory-tier row's whole cost is that hop and a dict lookup)."""
    conc = max(c[0] for c in costs)
    by = {name: cpu for c, name, _, cpu, _ in costs if c == conc}
    budget = 2 * sum(by["raw boto3 GET"].values())
    floor = by["service get (S3 path)"]["weed"] + sum(by["service get (memory tier)"].values())
    console.print(
        f"concurrency {conc}: CPU budget per object for 0.5x of raw GET = 2 x "
        f"{budget / 2:.1f} = {budget:.1f} ms; weed's 10 shard GETs ("
        f"{by['service get (S3 path)']['weed']:.1f} ms) + the gRPC hop (memory-tier row, "
        f"{sum(by['service get (memory tier)'].values()):.1f} ms) = {floor:.1f} ms before the "
        f"kvstore receives or checks a byte -> S3-path ceiling on this machine ~"
        f"{budget / 2 / floor:.2f}x of raw")


def plot(codec, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r[0] for r in codec]
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [r[1] for r in codec], 0.4, label="encode")
    a.bar([i + 0.2 for i in x], [r[2] for r in codec], 0.4, label="decode (2 lost)")
    a.set_xticks(list(x), names, fontsize=8)
    a.set_ylabel("GB/s")
    a.set_title("erasure coding 10+2")
    a.legend()
    labels = ["raw PUT", "raw GET", "svc put", "svc get S3", "svc get mem", "in-proc read"]
    for j, row in enumerate(rows):
        b.bar([i + 0.4 * j for i in range(len(labels))], row[1:], 0.4,
              label=f"concurrency {row[0]}")
    b.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=8)
    b.set_ylabel("MB/s")
    b.set_title("end to end vs raw boto3 (same SeaweedFS)")
    b.legend()
    fig.tight_layout()
    fig.savefig(OUT / "kvstore_throughput.png", dpi=100)
    print(f"wrote {OUT / 'kvstore_throughput.png'}")


if __name__ == "__main__":
    main()
