"""`kvmesh gateway serve` (the remote half of `kvmesh generate` is launch/generate.py).

Flags override `KVMESH_GATEWAY_*` environment variables (see config.py).
"""

from __future__ import annotations

import argparse
import sys

from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.tls import add_flags as add_tls_flags


def register(sub) -> None:
    gw = sub.add_parser("gateway", help="gateway commands (the public Generate API)")
    gsub = gw.add_subparsers(dest="gateway_command", required=True)
    serve = gsub.add_parser("serve", help="serve GatewayService over gRPC")
    serve.add_argument("--host", help="address to listen on, gRPC and HTTP "
                       "(default $KVMESH_GATEWAY_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="gRPC port (default $KVMESH_GATEWAY_PORT or 7000)")
    serve.add_argument("--engines", help="static engines host:port,... "
                       "(default $KVMESH_GATEWAY_ENGINES or none)")
    serve.add_argument("--directory", help="directory host:port for live engines and snapshot "
                       "lookups (default $KVMESH_GATEWAY_DIRECTORY or none)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus /metrics port; 0 = a free "
                       "port, -1 = off (default $KVMESH_GATEWAY_METRICS_PORT or -1)")
    serve.add_argument("--http-port", type=int, help="OpenAI-compatible HTTP API port "
                       "(/v1/completions, /v1/chat/completions, ...); 0 = a free port, -1 = off "
                       "(default $KVMESH_GATEWAY_HTTP_PORT or -1)")
    serve.add_argument("--tokenizer", help="tokenizer.json for routing keys; a "
                       "tokenizer_config.json beside it may give the HTTP chat_template "
                       "(default byte-level)")
    serve.add_argument("--max-attempts", type=int, help="engines tried before the first token "
                       "(default $KVMESH_GATEWAY_MAX_ATTEMPTS or 3)")
    serve.add_argument("--migration-limit", type=int,
                       help="times a stream whose engine fails after the first token is continued "
                       "on another engine; 0 = off (default $KVMESH_GATEWAY_MIGRATION_LIMIT or 1)")
    serve.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"),
                       help="default uvloop; auto = uvloop when installed "
                       "($KVMESH_GATEWAY_EVENT_LOOP)")
    serve.add_argument("--engine-calls", dest="engine_sessions", action="store_const",
                       const=False, help="one Generate call per request instead of a Session "
                       "stream per engine ($KVMESH_GATEWAY_ENGINE_SESSIONS=false)")
    serve.add_argument("--api-keys", help="file of 'key tenant role' lines; callers must send "
                       "'authorization: Bearer <key>' (default $KVMESH_GATEWAY_API_KEYS or "
                       "none = auth off)")
    serve.add_argument("--allow-unauthenticated", action="store_const", const=True,
                       help="listen beyond loopback (--host 0.0.0.0) without --api-keys, which "
                       "is refused otherwise (default $KVMESH_GATEWAY_ALLOW_UNAUTHENTICATED "
                       "or false)")
    add_tls_flags(serve)
    serve.add_argument("--prefill-engines", help="prefill/decode disaggregation: prefill "
                       "engines host:port,... (with --decode-engines; default "
                       "$KVMESH_GATEWAY_PREFILL_ENGINES or none = off)")
    serve.add_argument("--decode-engines", help="decode engines host:port,... (default "
                       "$KVMESH_GATEWAY_DECODE_ENGINES)")
    serve.add_argument("--strict-fields", action="store_const", const=True,
                       help="HTTP API: refuse a request with a field the API does not know (400 "
                       "naming it) instead of ignoring it with a warning header, as vLLM does "
                       "(default $KVMESH_GATEWAY_STRICT_FIELDS or false)")
    serve.set_defaults(func=_serve)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig.from_env(host=args.host, port=args.port, engines=args.engines,
                                  directory=args.directory, metrics_port=args.metrics_port,
                                  http_port=getattr(args, "http_port", None),
                                  tokenizer=args.tokenizer, max_attempts=args.max_attempts,
                                  migration_limit=getattr(args, "migration_limit", None),
                                  event_loop=getattr(args, "event_loop", None),
                                  engine_sessions=getattr(args, "engine_sessions", None),
                                  api_keys=getattr(args, "api_keys", None),
                                  allow_unauthenticated=getattr(args, "allow_unauthenticated",
                                                                None),
                                  prefill_engines=getattr(args, "prefill_engines", None),
                                  decode_engines=getattr(args, "decode_engines", None),
                                  strict_fields=getattr(args, "strict_fields", None))


def _serve(args: argparse.Namespace) -> int:
    from kvmesh.auth import check_public_bind
    from kvmesh.errors import InvalidArgument
    from kvmesh.services.gateway.service import run, serve

    try:
        cfg = config_from_args(args)
        check_public_bind(cfg.host, bool(cfg.api_keys), cfg.allow_unauthenticated)
    except (ValueError, InvalidArgument) as exc:
        print(f"kvmesh gateway: {exc}", file=sys.stderr)
        return 2
    if not cfg.engines and not cfg.directory:
        print("kvmesh gateway: give --engines and/or --directory", file=sys.stderr)
        return 2
    try:
        run(serve(cfg), cfg.event_loop)
    except (ValueError, OSError) as exc:  # uvloop asked for but not installed; port taken
        print(f"kvmesh gateway: {exc}", file=sys.stderr)
        return 2
    return 0
