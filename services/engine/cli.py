"""`kvmesh engine serve`, `kvmesh engine layout` and `kvmesh generate` (local in-process,
or against a server)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from kvmesh.errors import KvmeshError
from kvmesh.generation import DEFAULT_MAX_TOKENS
from kvmesh.tls import add_flags as add_tls_flags
from services.engine.build import add_engine_args, build_core, choose_model, runtime_layout


def register(sub) -> None:
    eng = sub.add_parser("engine", help="engine commands")
    esub = eng.add_subparsers(dest="engine_command", required=True)
    serve = esub.add_parser("serve", help="serve EngineService over gRPC")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=7200, help="gRPC port")
    serve.add_argument("--engine-id", default="", help="name in the directory (default engine-PORT)")
    serve.add_argument("--advertise", default="", help="host:port peers and the gateway use "
                                                       "(default HOST:PORT)")
    serve.add_argument("--directory", default="", help="directory address: publish snapshots, "
                                                       "heartbeat, fetch peers' snapshots")
    serve.add_argument("--kvstore", default="", help="kvstore address: write blocks through, "
                                                     "fetch missing prefix blocks; a,b,...: "
                                                     "replicas sharing one index, spread by "
                                                     "key hash with fall-over")
    serve.add_argument("--swa-fetch", default="auto", choices=["auto", "always", "never"],
                       help="peer snapshot fetch vs bounded replay (auto: cost model)")
    serve.add_argument("--fetch-deadline-ms", type=int, default=1000,
                       help="a peer snapshot fetch slower than this replays instead")
    serve.add_argument("--threads", type=int, default=None,
                       help="CPU threads of the forward (default: $OMP_NUM_THREADS if set, else "
                            "the CPUs less one, at least 1: the gRPC server's thread streams "
                            "every token beside the engine's, and a forward on every CPU "
                            "slows both)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus /metrics on this port (0 = any free port; "
                       "default: off)")
    add_engine_args(serve)
    add_tls_flags(serve)
    serve.set_defaults(func=_serve)

    lay = esub.add_parser("layout", help="print ring sizes, slot regions and bytes, and what fits "
                                         "a memory budget, for the given engine flags (no engine "
                                         "is started)")
    lay.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lay.add_argument("--memory", type=_budget, default=None,
                     help="cache memory budget (e.g. 80GiB): slots and blocks that fit it "
                     "(default: none, no budget report)")
    lay.add_argument("--config", help="a DeepSeek V4 config.json: both ledgers from it, as "
                     "--model DIR (engine flags other than --extra-state and --memory do not "
                     "apply; default: none)")
    add_engine_args(lay)
    lay.set_defaults(func=_layout)

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


def _serve(args) -> int:
    import torch

    from services.engine.rpc.server import serve

    torch.set_num_threads(serve_threads(args.threads))
    try:
        core = build_core(args)
    except ValueError as exc:
        print(f"kvmesh engine: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(core, f"{args.host}:{args.port}", args.engine_id, args.advertise,
                      args.directory, args.kvstore, args.swa_fetch, args.fetch_deadline_ms / 1000,
                      args.metrics_port))
    return 0


def serve_threads(given: int | None, env=None) -> int:
    """--threads as given, else $OMP_NUM_THREADS, else the CPUs this process may use less one."""
    env = os.environ if env is None else env
    if given is not None:
        if given < 1:
            raise SystemExit(f"kvmesh engine: --threads must be >= 1, not {given}")
        return given
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _budget(text: str) -> int:
    from services.engine.layout_report import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        import argparse

        raise argparse.ArgumentTypeError(str(exc)) from None


def _layout(args) -> int:
    if not args.config:
        try:
            choose_model(args)
        except ValueError as exc:
            print(f"kvmesh engine layout: {exc}", file=sys.stderr)
            return 2
    if args.model or args.config:
        return _v4_layout(args)
    from services.engine import layout_report

    try:
        _, _, layout = runtime_layout(args)
    except ValueError as exc:
        print(f"kvmesh engine layout: {exc}", file=sys.stderr)
        return 2
    report = layout_report.to_dict(layout, args.memory)
    print(json.dumps(report, indent=2) if args.json else layout_report.table(report))
    return 0


def _v4_layout(args) -> int:
    from kvmesh.checkpoint_dir import is_v41
    from services.engine.model.deepseek_v4 import layout as v4_layout
    from services.engine.model.deepseek_v4 import v41_layout, window_rows
    from services.engine.model.deepseek_v4.config import read_config
    from services.engine.model.deepseek_v4.errors import CheckpointError
    from services.engine.model.deepseek_v4.v41_config import read_v41_config

    if args.model and args.config:
        print("kvmesh engine layout: give --model or --config, not both", file=sys.stderr)
        return 2
    path = args.model or args.config
    rows_format = window_rows.for_dtype(args.dtype)
    try:
        if is_v41(path):
            layout_module = v41_layout
            import torch

            from services.engine.model.deepseek_v4.v41_forward import wide
            report = v41_layout.report(read_v41_config(path, serving=False),
                                       extra_state=bool(args.extra_state), memory=args.memory,
                                       rows_format=rows_format,
                                       state_dtype=wide(getattr(torch, args.dtype)))
        else:
            layout_module = v4_layout
            report = v4_layout.report(read_config(path), extra_state=bool(args.extra_state),
                                      memory=args.memory, rows_format=rows_format)
    except (CheckpointError, ValueError) as exc:
        print(f"kvmesh engine layout: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else layout_module.table(report))
    return 0


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
    from kvmesh.generate import generate_remote

    return generate_remote(args)


def _generate_local(args) -> int:
    from kvmesh.generation import controls_given
    from services.engine.core.sampling import SamplingParams

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
