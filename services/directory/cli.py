"""`kvmesh directory serve`: run the directory service against a Redis/Valkey URL.

Flags override `KVMESH_DIRECTORY_*` environment variables (see config.py).
SIGTERM/SIGINT stop it gracefully (health goes NOT_SERVING, in-flight calls finish).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvmesh.clihelp import env_default
from kvmesh.services.directory.config import DirectoryConfig
from kvmesh.tls import add_flags as add_tls_flags

log = logging.getLogger("kvmesh.directory")


def register(subparsers) -> None:
    parser = subparsers.add_parser("directory", help="snapshot directory service (Redis-backed)")
    sub = parser.add_subparsers(dest="directory_command", required=True)
    serve = sub.add_parser("serve", help="serve DirectoryService over gRPC")
    d = lambda name: env_default(DirectoryConfig, "KVMESH_DIRECTORY_", name)  # noqa: E731
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on, gRPC and "
                       "/metrics (default 127.0.0.1; 0.0.0.0 = every interface)")
    serve.add_argument("--port", type=int, default=50070, help="gRPC port")
    serve.add_argument("--redis-url", help="default: $KVMESH_DIRECTORY_REDIS_URL or "
                       "redis://127.0.0.1:6379/0; credentials: $KVMESH_DIRECTORY_REDIS_USERNAME "
                       "and $KVMESH_DIRECTORY_REDIS_PASSWORD (never a flag: ps shows flags)")
    serve.add_argument("--key-prefix", help=f"prefix of every Redis key ({d('key_prefix')})")
    serve.add_argument("--entry-ttl-s", type=float,
                       help=f"default lifetime of a published snapshot entry ({d('entry_ttl_s')})")
    serve.add_argument("--lease-ttl-s", type=float,
                       help=f"an engine drops out this long after its last heartbeat "
                       f"({d('lease_ttl_s')})")
    serve.add_argument("--sweep-interval-s", type=float,
                       help=f"seconds between sweeps of lapsed engines ({d('sweep_interval_s')})")
    serve.add_argument("--max-batch", type=int,
                       help=f"most keys in one Lookup or Publish ({d('max_batch')})")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus /metrics on this port (default: off)")
    add_tls_flags(serve)
    serve.set_defaults(func=run_serve)


def config_from_args(args: argparse.Namespace) -> DirectoryConfig:
    return DirectoryConfig.from_env(
        redis_url=args.redis_url, key_prefix=args.key_prefix, entry_ttl_s=args.entry_ttl_s,
        lease_ttl_s=args.lease_ttl_s, sweep_interval_s=args.sweep_interval_s,
        max_batch=args.max_batch,
    )


async def serve(config: DirectoryConfig, address: str) -> None:
    from kvmesh.rpc import shutdown_signal
    from kvmesh.services.directory.service import DirectoryServer  # grpc only when serving

    stop = shutdown_signal()
    server = await DirectoryServer(config, address).start()
    log.info("directory listening on %s:%d (redis %s, prefix %s)", address.rpartition(":")[0],
             server.port, config.redacted_url, config.key_prefix)
    try:
        await stop.wait()
    finally:
        await server.stop()


def run_serve(args: argparse.Namespace) -> int:
    if args.metrics_port is not None:
        from kvmesh.metrics import serve_metrics

        serve_metrics(args.metrics_port, args.host)
    asyncio.run(serve(config_from_args(args), f"{args.host}:{args.port}"))
    return 0
