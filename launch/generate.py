"""`kvmesh generate`: stream a generation to the terminal, through a gateway (or, for
debugging, straight from one engine), or with `--local` from an engine in this process;
usage at the end.

A launcher module: it drives both services' typed clients and builds an engine in process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import grpc

from kvmesh.errors import KvmeshError
from kvmesh.generation import DEFAULT_MAX_TOKENS, controls_given, finish_name
from kvmesh.rpc import exit_code
from kvmesh.services.engine.build import add_engine_args, build_core
from kvmesh.tls import add_flags as add_tls_flags


def register(sub) -> None:
    gen = sub.add_parser(
        "generate", help="generate text and stream it to the terminal",
        description="Stream generated text to stdout and a usage line to stderr. Runs through "
        "the gateway unless --local or --engine is given. Bad input exits 2 with the status.")
    gen.add_argument("prompt", nargs="?",
                     help="prompt text; - reads it from stdin (for long prompts; see --prompt-file)")
    gen.add_argument("--prompt-file", help="read the prompt from this UTF-8 file (- = stdin) "
                     "instead of the command line (default: the prompt argument)")
    where = gen.add_argument_group("where it runs (default: through the gateway)"
                                   ).add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true",
                       help="run the model in this process (flags under 'local only' apply)")
    where.add_argument("--engine", help="send straight to one engine host:port, bypassing the "
                       "gateway (debugging; default: through the gateway)")
    where.add_argument("--gateway", default=None, help="gateway address (default "
                       "$KVMESH_GATEWAY_ADDR or 127.0.0.1:7000)")
    gen.add_argument("--api-key", default=None,
                     help="gateway API key, for a gateway with API keys on (default "
                     "$KVMESH_API_KEY; none: unauthenticated)")
    samp = gen.add_argument_group("sampling")
    samp.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens to generate at most")
    # unset sampling flags take the engine's defaults, the same as gRPC's and HTTP's
    samp.add_argument("--temperature", type=float, default=None,
                      help="0 = greedy (default: the engine's, 1.0, as over HTTP and gRPC)")
    samp.add_argument("--top-k", type=int, default=None,
                      help="sample from the k likeliest; 0 = off (default 0)")
    samp.add_argument("--top-p", type=float, default=None,
                      help="nucleus sampling mass in (0, 1] (default 1)")
    samp.add_argument("--seed", type=int, default=None,
                      help="sampling seed, as vLLM's (default: none, a fresh draw per request)")
    samp.add_argument("--min-p", type=float, default=None,
                      help="drop tokens below min_p x the likeliest one's probability (default 0)")
    samp.add_argument("--presence-penalty", type=float, default=None,
                      help="in [-2, 2], subtracted once from each generated token (default 0)")
    samp.add_argument("--frequency-penalty", type=float, default=None,
                      help="in [-2, 2], subtracted per occurrence in the output (default 0)")
    samp.add_argument("--repetition-penalty", type=float, default=None,
                      help="> 0, divides prompt and output tokens' positive logits (default 1)")
    samp.add_argument("--stop", action="append", default=[], type=unescape,
                      help="stop string, repeatable; backslash escapes are decoded, so \"\\n\" "
                      "is a newline (default: none)")
    local = add_engine_args(gen, title="local only (--local): model and cache")
    gen.set_defaults(local_only={a.dest: (a.option_strings[0], a.default)
                                 for a in local._group_actions})
    add_tls_flags(gen)
    gen.set_defaults(func=_generate)


def unescape(text: str) -> str:
    """`--stop "\\n"` from a shell is a backslash and an n: decode Python-style escapes
    (\\n, \\t, \\\\, \\x41, \\u00e9); other characters pass through unchanged."""
    try:
        # latin-1 + backslashreplace keeps non-Latin characters as \\uXXXX escapes, which
        # unicode_escape turns back into themselves.
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        import argparse

        raise argparse.ArgumentTypeError(f"bad escape in {text!r}: {exc.reason}") from None


def read_prompt(args, stdin=None) -> str:
    """The prompt from the argument, `-` (stdin) or --prompt-file; ValueError if none or two."""
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give the prompt as an argument or with --prompt-file, not both")
    source = args.prompt_file if args.prompt_file is not None else args.prompt
    if source is None:
        raise ValueError("no prompt: give it as an argument, - for stdin, or --prompt-file PATH")
    if args.prompt_file is None and source != "-":
        return source
    try:
        data = (stdin or sys.stdin.buffer).read() if source == "-" else Path(source).read_bytes()
        return data.decode("utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the prompt: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"the prompt is not valid UTF-8: {exc}") from None


def check_no_local_flags(args) -> None:
    """Model and cache flags only mean something with --local: refuse them elsewhere
    instead of ignoring them (the gateway's engines have their own)."""
    given = [flag for dest, (flag, default) in args.local_only.items()
             if getattr(args, dest) != default]
    if given:
        raise ValueError(f"{', '.join(given)} only apply with --local (the engines behind "
                         "the gateway have their own settings)")


def _generate(args) -> int:
    try:
        args.prompt = read_prompt(args)
        if not args.local:
            check_no_local_flags(args)
    except ValueError as exc:
        print(f"kvmesh generate: {exc}", file=sys.stderr)
        return 2
    if args.local:
        return _generate_local(args)
    return generate_remote(args)


def _generate_local(args) -> int:
    from kvmesh.services.engine.core.sampling import SamplingParams

    try:
        core = build_core(args)
        given = {k: v for k in ("temperature", "top_k", "top_p")
                 if (v := getattr(args, k)) is not None}
        params = SamplingParams(seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                                **given, **controls_given(args))
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


def generate_remote(args: argparse.Namespace) -> int:
    """`kvmesh generate "prompt"` through a gateway: text as it streams, usage at the end."""
    from kvmesh.services.gateway.config import client_address

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
        from kvmesh.services.engine.rpc.client import EngineClient

        client, served_by = EngineClient(engine), engine
        stream = client.generate(args.prompt, **kw)
    else:
        from kvmesh.services.gateway.client import GatewayClient

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
