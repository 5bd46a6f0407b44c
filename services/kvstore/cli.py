"""`kvmesh kvstore serve` and `kvmesh admin {gc run|gc stats|ls|scrub|reindex}`.

Admin commands talk gRPC to `--kvstore ADDR` (default $KVMESH_KVSTORE_ADDR or
127.0.0.1:7100) and draw progress and tables with rich.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvmesh.clihelp import env_default
from kvmesh.generation import traffic_class_name
from kvmesh.rpc import exit_code
from kvmesh.running import RUNNING_MESH_FILE
from kvmesh.services.kvstore.client import KvstoreClient
from kvmesh.services.kvstore.config import KvstoreConfig
from kvmesh.tls import add_flags as add_tls_flags

log = logging.getLogger("kvmesh.kvstore.cli")
DEFAULT_ADDR = "127.0.0.1:7100"


def register(sub: argparse._SubParsersAction) -> None:
    kv = sub.add_parser("kvstore", help="the erasure-coded block store")
    kv_sub = kv.add_subparsers(dest="kvstore_command", required=True)
    serve = kv_sub.add_parser("serve", help="run the kvstore gRPC service")
    d = lambda name: env_default(KvstoreConfig, "KVMESH_KVSTORE_", name)  # noqa: E731
    serve.add_argument("--host", default=None, help=f"address to listen on ({d('host')})")
    serve.add_argument("--port", type=int, default=None, help=f"gRPC port ({d('port')})")
    serve.add_argument("--locations", default=None,
                       help="12 comma-separated http://host:port/bucket shard locations "
                       "(default $KVMESH_KVSTORE_LOCATIONS)")
    serve.add_argument("--data-dir", default=None,
                       help=f"local disk tier and the object index ({d('data_dir')})")
    serve.add_argument("--mem-bytes", type=int, default=None,
                       help=f"memory LRU tier, bytes ({d('mem_bytes')})")
    serve.add_argument("--disk-bytes", type=int, default=None,
                       help=f"local-disk LRU tier, bytes ({d('disk_bytes')})")
    serve.add_argument("--capacity-bytes", type=int, default=None,
                       help=f"durable bytes GC keeps under ({d('capacity_bytes')})")
    serve.add_argument("--gc-interval-s", type=float, default=None,
                       help=f"seconds between GC runs ({d('gc_interval_s')})")
    serve.add_argument("--index", default=None,
                       help="live index: sqlite (a file in --data-dir, one kvstore process) or "
                       "redis://host:port/db shared by several kvstore replicas over the same "
                       "locations; credentials from $KVMESH_KVSTORE_REDIS_USERNAME/_PASSWORD "
                       f"({d('index')})")
    serve.add_argument("--index-prefix", default=None,
                       help=f"key prefix of the shared index ({d('index_prefix')})")
    serve.add_argument("--replica", default=None,
                       help="this replica's name in the maintenance lease log (default host:pid)")
    serve.add_argument("--lease-ttl-s", type=float, default=None,
                       help=f"GC/scrub lease of a dead replica frees after ({d('lease_ttl_s')})")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus /metrics on this port (bytes per tier, GC "
                       "activity; default: off)")
    serve.add_argument("--create-buckets", action="store_true",
                       help="create missing shard buckets at start (fresh S3 servers, compose)")
    add_tls_flags(serve)
    serve.set_defaults(func=_serve)

    admin = sub.add_parser("admin", help="kvstore administration over gRPC")
    admin.add_argument("--kvstore", default=None,
                       help="kvstore address (default $KVMESH_KVSTORE_ADDR, else the kvstore of "
                       f"the `kvmesh up` running from this directory ({RUNNING_MESH_FILE}), "
                       f"else {DEFAULT_ADDR})")
    admin.add_argument("--timeout", type=float, default=600.0, help="seconds per admin call")
    admin.add_argument("--json", action="store_true",
                       help="print each command's result as JSON (the RPC's reply) instead of "
                       "tables (default: tables)")
    add_tls_flags(admin)
    admin_sub = admin.add_subparsers(dest="admin_command", required=True,
                                     metavar="{gc,ls,scrub,reindex}")
    gc = admin_sub.add_parser("gc", help="garbage collection")
    gc_sub = gc.add_subparsers(dest="gc_command", required=True, metavar="{run,stats}")
    run = gc_sub.add_parser("run", help="run GC now (TTL, LRU over capacity, orphans)")
    run.add_argument("--dry-run", action="store_true", help="report only, change nothing")
    run.set_defaults(func=_gc_run)
    gc_sub.add_parser("stats", help="usage, capacity, locations").set_defaults(func=_stats)
    ls = admin_sub.add_parser("ls", help="list stored objects")
    ls.add_argument("--limit", type=int, default=50, help="rows to show (0 = all)")
    ls.set_defaults(func=_ls)
    scrub = admin_sub.add_parser("scrub", help="check every object's shards")
    scrub.add_argument("--repair", action="store_true", help="rewrite missing/corrupt shards")
    scrub.set_defaults(func=_scrub)
    reidx = admin_sub.add_parser("reindex", help="rebuild a lost index from the shard "
                                 "locations' manifests (adds what the index lacks)")
    reidx.set_defaults(func=_reindex)


# -- serve -------------------------------------------------------------------------
def _serve(args) -> int:
    cfg = KvstoreConfig.from_env(
        host=args.host, port=args.port, locations=args.locations, data_dir=args.data_dir,
        mem_bytes=args.mem_bytes, disk_bytes=args.disk_bytes,
        capacity_bytes=args.capacity_bytes, gc_interval_s=args.gc_interval_s,
        index=args.index, index_prefix=args.index_prefix, replica=args.replica,
        lease_ttl_s=args.lease_ttl_s,
    )
    if args.create_buckets:
        _create_buckets(cfg)
    asyncio.run(_serve_async(cfg, args.metrics_port))
    return 0


def _create_buckets(cfg: KvstoreConfig, wait_s: float = 60.0) -> None:
    """Make every shard bucket exist, waiting for S3 servers that are still starting."""
    import time

    from kvmesh.s3 import ensure_bucket, s3_client

    deadline = time.monotonic() + wait_s
    for loc in cfg.locations:
        while True:
            try:
                ensure_bucket(s3_client(loc.endpoint), loc.bucket)
                break
            except Exception as exc:  # noqa: BLE001 - S3 not up yet: retry until the deadline
                if time.monotonic() > deadline:
                    raise SystemExit(f"kvstore: cannot create bucket {loc.bucket} at "
                                     f"{loc.endpoint}: {exc}") from None
                time.sleep(1.0)


async def _serve_async(cfg: KvstoreConfig, metrics_port: int | None = None) -> None:
    from kvmesh.services.kvstore.server import KvstoreServer

    server = KvstoreServer(cfg)
    port = await server.start()
    if metrics_port is not None:
        _export_metrics(server, metrics_port, cfg.host)
    log.info("kvstore serving on %s:%d (%d shard locations, data in %s)",
             cfg.host, port, len(cfg.locations), cfg.data_dir)
    from kvmesh.rpc import shutdown_signal

    stop = shutdown_signal()
    await stop.wait()
    log.info("kvstore stopping")
    await server.stop()


def _export_metrics(server, port: int, host: str) -> None:
    """Read at scrape time from plain attributes (no I/O): durable bytes, hot-tier bytes and
    locations down (gauges), and the core's counters (GC deletions, bytes freed, repairs,
    ...: Prometheus counters, `_total`)."""
    from kvmesh.metrics import StatsExporter, serve_metrics

    core = server.core

    from kvmesh.services.kvstore.core import GC_COUNTERS, READ_COUNTERS

    def read() -> dict[str, float]:
        return {"durable_bytes": core.meta.complete_bytes, "mem_bytes": core.mem.used,
                "disk_bytes": core.disk.used, **dict.fromkeys(GC_COUNTERS + READ_COUNTERS, 0),
                "locations_down": len(core.cfg.locations) - core.shards.up_count(),
                **dict(core.counters)}

    StatsExporter("kvstore", read,
                  counters=lambda: set(GC_COUNTERS + READ_COUNTERS) | set(core.counters))
    serve_metrics(port, host)


# -- admin -------------------------------------------------------------------------
def admin_address(flag: str | None, env=None) -> str:
    """--kvstore, else $KVMESH_KVSTORE_ADDR, else the running `kvmesh up`'s kvstore (the
    file it writes while it runs), else 127.0.0.1:7100."""
    env = os.environ if env is None else env
    if flag:
        return flag
    if env.get("KVMESH_KVSTORE_ADDR"):
        return env["KVMESH_KVSTORE_ADDR"]
    from kvmesh.running import running_endpoints

    return running_endpoints().get("kvstore") or DEFAULT_ADDR


def _use_mesh_tokens(address: str) -> None:
    """Without $KVMESH_SERVICE_TOKEN / $KVMESH_ADMIN_TOKEN, take those of the running
    `kvmesh up` that serves `address` (kvmesh/running.py); the channel sends them."""
    from kvmesh.running import tokens_for

    if "KVMESH_SERVICE_TOKEN" in os.environ or "KVMESH_ADMIN_TOKEN" in os.environ:
        return
    for name, token in tokens_for(address).items():
        os.environ[name] = token


def _run(args, fn) -> int:
    address = admin_address(args.kvstore)
    _use_mesh_tokens(address)

    async def go():
        async with KvstoreClient(address, timeout=args.timeout) as client:
            return await fn(client)

    import grpc

    try:
        return asyncio.run(go()) or 0
    except grpc.aio.AioRpcError as exc:
        Console(stderr=True).print(f"[red]{exc.code().name}[/red]: {exc.details()}")
        return exit_code(exc)       # as `kvmesh generate`: 2 for bad input, else 1


def _json(message) -> None:
    """--json: the reply as JSON on stdout (field names as in the proto)."""
    import json
    import sys

    from google.protobuf.json_format import MessageToDict

    body = message if isinstance(message, dict | list) else MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    sys.stdout.write(json.dumps(body, indent=2) + "\n")


def _console(args) -> Console:
    """Tables on stdout; with --json, progress on stderr and stdout holds the JSON only."""
    # Piped output (grep, tests) gets full-width rows: 64-hex keys must not be cut.
    import sys

    if getattr(args, "json", False):
        return Console(stderr=True)
    return Console(width=None if sys.stdout.isatty() else 220)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console)


async def _drain(stream, console: Console, label: str):
    report = None
    with _progress(console) as bar:
        task = bar.add_task(label, total=None)
        async for msg in stream:
            if msg.WhichOneof("part") == "progress":
                p = msg.progress
                bar.update(task, description=f"{label} ({p.phase})", completed=p.done,
                           total=p.total)
            else:
                report = msg.report
    return report


def _gc_run(args) -> int:
    console = _console(args)

    async def go(client: KvstoreClient):
        r = await _drain(client.run_gc_stream(args.dry_run), console, "gc")
        if args.json:
            return _json(r)
        verb = "would remove" if r.dry_run else "removed"
        table = Table(title=f"GC ({'dry run' if r.dry_run else 'applied'})")
        table.add_column("reason")
        table.add_column("objects", justify="right")
        for name, keys in [("expired (TTL)", r.expired), ("evicted (LRU)", r.evicted),
                           ("stale uploads", r.stale), ("orphan shards", r.orphans),
                           ("skipped (being read)", r.skipped_busy)]:
            table.add_row(name, str(len(keys)))
        console.print(table)
        console.print(f"{verb} {r.bytes_freed:,} of {r.bytes_before:,} bytes")

    return _run(args, go)


def _stats(args) -> int:
    console = _console(args)

    async def go(client: KvstoreClient):
        s = await client.stats()
        if args.json:
            return _json(s)
        table = Table(title="kvstore")
        table.add_column("")
        table.add_column("objects", justify="right")
        table.add_column("bytes", justify="right")
        table.add_column("capacity", justify="right")
        table.add_row("durable (S3, EC 10+2)", str(s.objects), f"{s.bytes:,}",
                      f"{s.capacity_bytes:,} (GC {s.high_watermark:.0%} -> {s.low_watermark:.0%})")
        for c in s.classes:
            table.add_row(f"  class {traffic_class_name(c.traffic_class)}", str(c.objects), f"{c.bytes:,}", "")
        table.add_row("memory tier", str(s.mem_objects), f"{s.mem_bytes:,}", f"{s.mem_capacity:,}")
        table.add_row("disk tier", str(s.disk_objects), f"{s.disk_bytes:,}", f"{s.disk_capacity:,}")
        table.add_row("uploads in flight", str(s.pending), "", "")
        console.print(table)
        up = sum(loc.up for loc in s.locations)
        console.print(f"shard locations up: {up}/{len(s.locations)}")
        for loc in s.locations:
            if not loc.up:
                console.print(f"  [red]down[/red] {loc.index}: {loc.location}")
        if s.counters:
            console.print("counters: " + ", ".join(f"{k}={v}" for k, v in sorted(s.counters.items())))

    return _run(args, go)


def _ls(args) -> int:
    console = _console(args)

    async def go(client: KvstoreClient):
        if args.json:
            from google.protobuf.json_format import MessageToDict

            rows = [MessageToDict(o, preserving_proto_field_name=True,
                                  always_print_fields_with_no_presence=True)
                    async for o in client.list_all()]
            return _json(rows[: args.limit] if args.limit else rows)
        table = Table()
        for col in ("key", "size", "class", "last access (UTC)", "state"):
            table.add_column(col, justify="right" if col == "size" else "left", no_wrap=True)
        shown = total = 0
        async for obj in client.list_all():
            total += 1
            if args.limit and shown >= args.limit:
                continue
            shown += 1
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(obj.last_access_unix))
            table.add_row(obj.key, f"{obj.size:,}", traffic_class_name(obj.traffic_class), when,
                          "ok" if obj.complete else "uploading")
        console.print(table)
        console.print(f"{shown} of {total} objects shown")

    return _run(args, go)


def _scrub(args) -> int:
    console = _console(args)

    async def go(client: KvstoreClient):
        r = await _drain(client.scrub_stream(args.repair), console, "scrub")
        if args.json:
            _json(r)
            return 1 if r.lost or (r.degraded and not args.repair) else 0
        console.print(
            f"scrubbed {r.objects} objects: {r.healthy} healthy, {len(r.degraded)} degraded, "
            f"{len(r.lost)} lost; {r.shards_bad} bad shards, {r.shards_repaired} repaired"
        )
        for key in r.degraded:
            console.print(f"  degraded {key}")
        for key in r.lost:
            console.print(f"  [red]lost[/red] {key}")
        return 1 if r.lost or (r.degraded and not args.repair) else 0

    return _run(args, go)


def _reindex(args) -> int:
    console = _console(args)

    async def go(client: KvstoreClient):
        r = await _drain(client.reindex_stream(), console, "reindex")
        if args.json:
            _json(r)
            return 1 if r.unreadable else 0
        console.print(f"found {r.objects} objects and {r.runs} runs holding {r.blocks_found} "
                      f"blocks; {r.restored} index records restored")
        for name in r.unreadable:
            console.print(f"  [red]unreadable[/red] {name}")
        return 1 if r.unreadable else 0

    return _run(args, go)
