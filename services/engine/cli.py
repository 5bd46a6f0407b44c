"""`kvmesh engine serve`, `kvmesh engine layout` and `kvmesh generate` (local in-process,
or against a server)."""

from __future__ import annotations

import asyncio
import json
import sys

from kvmesh.errors import KvmeshError
from services.engine.build import add_engine_args, build_core, runtime_layout


def register(sub) -> None:
    eng = sub.add_parser("engine", help="engine commands")
    esub = eng.add_subparsers(dest="engine_command", required=True)
    serve = esub.add_parser("serve", help="serve EngineService over gRPC")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=7200)
    serve.add_argument("--engine-id", default="", help="name in the directory (default engine-PORT)")
    serve.add_argument("--advertise", default="", help="host:port peers and the gateway use "
                                                       "(default HOST:PORT)")
    serve.add_argument("--directory", default="", help="directory address: publish snapshots, "
                                                       "heartbeat, fetch peers' snapshots")
    serve.add_argument("--kvstore", default="", help="kvstore address: write blocks through, "
                                                     "fetch missing prefix blocks")
    serve.add_argument("--swa-fetch", default="auto", choices=["auto", "always", "never"],
                       help="peer snapshot fetch vs bounded replay (auto: cost model)")
    serve.add_argument("--fetch-deadline-ms", type=int, default=1000)
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus /metrics on this port (0 = any free port)")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

    lay = esub.add_parser("layout", help="print ring sizes, slot regions and bytes, and what fits "
                                         "a memory budget, for the given engine flags (no engine "
                                         "is started)")
    lay.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lay.add_argument("--memory", type=_budget, default=None,
                     help="cache memory budget (e.g. 80GiB): slots and blocks that fit it")
    add_engine_args(lay)
    lay.set_defaults(func=_layout)

    gen = sub.add_parser("generate", help="generate text and stream it to the terminal")
    gen.add_argument("prompt")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run the model in this process")
    where.add_argument("--engine", help="engine address host:port")
    where.add_argument("--gateway", default=None, help="gateway address (default $KVMESH_GATEWAY_ADDR "
                                                       "or 127.0.0.1:7000)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--gen-seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[])
    add_engine_args(gen)
    gen.set_defaults(func=_generate)


def _serve(args) -> int:
    from services.engine.server import serve

    try:
        core = build_core(args)
    except ValueError as exc:
        print(f"kvmesh engine: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(core, f"{args.host}:{args.port}", args.engine_id, args.advertise,
                      args.directory, args.kvstore, args.swa_fetch, args.fetch_deadline_ms / 1000,
                      args.metrics_port))
    return 0


def _budget(text: str) -> int:
    from services.engine.layout_report import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        import argparse

        raise argparse.ArgumentTypeError(str(exc)) from None


def _layout(args) -> int:
    from services.engine import layout_report

    try:
        _, _, layout = runtime_layout(args)
    except ValueError as exc:
        print(f"kvmesh engine layout: {exc}", file=sys.stderr)
        return 2
    report = layout_report.to_dict(layout, args.memory)
    print(json.dumps(report, indent=2) if args.json else layout_report.table(report))
    return 0


def _generate(args) -> int:
    if args.local:
        return _generate_local(args)
    from services.gateway.cli import generate_remote  # gateway issue provides this

    return generate_remote(args)


def _generate_local(args) -> int:
    from services.engine.sampling import SamplingParams

    try:
        core = build_core(args)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.gen_seed, max_tokens=args.max_tokens,
                                stop=tuple(args.stop))
        seq = core.add_request(core.tokenizer.encode(args.prompt), params)
    except (KvmeshError, ValueError) as exc:
        print(f"kvmesh generate: {exc}", file=sys.stderr)
        return 2
    while core.has_work:
        for ev in core.step():
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    print(f"\n[{seq.finish.value}: {len(seq.prompt)} prompt tokens, {len(seq.output)} generated]",
          file=sys.stderr)
    return 0
