"""The remote half of `kvmesh generate`: stream a generation from a gateway (or, for
debugging, straight from one engine) to the terminal, usage at the end.

A launcher module: it drives both services' typed clients, so it may import
`services.*` (see .importlinter); the services themselves never import each other.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from kvmesh.generation import controls_given, finish_name
from kvmesh.rpc import exit_code


def generate_remote(args: argparse.Namespace) -> int:
    """`kvmesh generate "prompt"` through a gateway: text as it streams, usage at the end."""
    from services.gateway.config import client_address

    address = getattr(args, "gateway", None) or client_address()
    engine = getattr(args, "engine", None)
    try:
        return asyncio.run(_stream(address, engine, args))
    except grpc.aio.AioRpcError as exc:
        print(f"\nkvmesh generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        # Bad input exits 2, as `--local` does; anything else (unreachable, failed) 1.
        return exit_code(exc)
    except KeyboardInterrupt:
        return 130


async def _stream(address: str, engine: str | None, args) -> int:
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, stop=args.stop,
              **controls_given(args))
    if engine:  # straight to one engine (debugging), same output format
        from services.engine.rpc.client import EngineClient

        client, served_by = EngineClient(engine), engine
        stream = client.generate(args.prompt, **kw)
    else:
        from services.gateway.client import GatewayClient

        client, served_by = GatewayClient(address, getattr(args, "api_key", None)), address
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
        print(f"\n[{finish_name(last.finish_reason) or 'unfinished'}: {u.prompt_tokens} prompt "
              f"tokens ({u.cached_tokens} cached, {u.replayed_tokens} replayed), "
              f"{u.generated_tokens} generated; engine {served_by}]", file=sys.stderr)
    return 0
