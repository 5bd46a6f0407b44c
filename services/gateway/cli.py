"""`kvmesh gateway serve` and the remote half of `kvmesh generate` (`generate_remote`).

Flags override `KVMESH_GATEWAY_*` environment variables (see config.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from services.gateway.config import GatewayConfig, client_address

FINISH_NAMES = {0: "unfinished", 1: "length", 2: "stop", 3: "aborted"}


def register(sub) -> None:
    gw = sub.add_parser("gateway", help="gateway commands (the public Generate API)")
    gsub = gw.add_subparsers(dest="gateway_command", required=True)
    serve = gsub.add_parser("serve", help="serve GatewayService over gRPC")
    serve.add_argument("--host", help="default $KVMESH_GATEWAY_HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, help="default $KVMESH_GATEWAY_PORT or 7000")
    serve.add_argument("--engines", help="static engines host:port,... ($KVMESH_GATEWAY_ENGINES)")
    serve.add_argument("--directory", help="directory host:port for live engines and snapshot "
                       "lookups ($KVMESH_GATEWAY_DIRECTORY)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus /metrics port; 0 = off "
                       "($KVMESH_GATEWAY_METRICS_PORT)")
    serve.add_argument("--tokenizer", help="tokenizer.json used for routing keys (default byte-level)")
    serve.add_argument("--max-attempts", type=int, help="engines tried before the first token (3)")
    serve.add_argument("--migration-limit", type=int,
                       help="times a stream whose engine fails after the first token is continued "
                       "on another engine; 0 = off (1; $KVMESH_GATEWAY_MIGRATION_LIMIT)")
    serve.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"),
                       help="default uvloop; auto = uvloop when installed "
                       "($KVMESH_GATEWAY_EVENT_LOOP)")
    serve.add_argument("--engine-calls", dest="engine_sessions", action="store_const",
                       const=False, help="one Generate call per request instead of a Session "
                       "stream per engine ($KVMESH_GATEWAY_ENGINE_SESSIONS=false)")
    serve.set_defaults(func=_serve)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig.from_env(host=args.host, port=args.port, engines=args.engines,
                                  directory=args.directory, metrics_port=args.metrics_port,
                                  tokenizer=args.tokenizer, max_attempts=args.max_attempts,
                                  migration_limit=getattr(args, "migration_limit", None),
                                  event_loop=getattr(args, "event_loop", None),
                                  engine_sessions=getattr(args, "engine_sessions", None))


def _serve(args: argparse.Namespace) -> int:
    from services.gateway.service import run, serve

    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"kvmesh gateway: {exc}", file=sys.stderr)
        return 2
    if not cfg.engines and not cfg.directory:
        print("kvmesh gateway: give --engines and/or --directory", file=sys.stderr)
        return 2
    try:
        run(serve(cfg), cfg.event_loop)
    except ValueError as exc:  # uvloop asked for but not installed
        print(f"kvmesh gateway: {exc}", file=sys.stderr)
        return 2
    return 0


def generate_remote(args: argparse.Namespace) -> int:
    """`kvmesh generate "prompt"` through a gateway: text as it streams, usage at the end."""
    address = getattr(args, "gateway", None) or client_address()
    engine = getattr(args, "engine", None)
    try:
        return asyncio.run(_stream(address, engine, args))
    except grpc.aio.AioRpcError as exc:
        print(f"\nkvmesh generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


async def _stream(address: str, engine: str | None, args) -> int:
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.gen_seed, stop=args.stop)
    if engine:  # straight to one engine (debugging), same output format
        from services.engine.client import EngineClient

        client, served_by = EngineClient(engine), engine
        stream = client.generate(args.prompt, **kw)
    else:
        from services.gateway.client import GatewayClient

        client, served_by = GatewayClient(address), address
        stream = client.stream(args.prompt, **kw)
    last = None
    try:
        async for msg in stream:
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            last = msg
    finally:
        await client.close()
    if last is not None:
        u = last.usage
        served_by = getattr(last, "engine_id", "") or served_by
        print(f"\n[{FINISH_NAMES.get(last.finish_reason, '?')}: {u.prompt_tokens} prompt tokens "
              f"({u.cached_tokens} cached, {u.replayed_tokens} replayed), {u.generated_tokens} "
              f"generated; engine {served_by}]", file=sys.stderr)
    return 0
