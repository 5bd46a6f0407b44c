"""`kvmesh engine serve` and `kvmesh engine layout` (`kvmesh generate`, which may run an
engine in process, is a launcher's: launch/generate.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from kvmesh.services.engine.build import add_engine_args, build_core, choose_model
from kvmesh.tls import add_flags as add_tls_flags


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
    serve.add_argument("--tensor-parallel", type=int, default=1,
                       help="DeepSeek V4 / V4.1: split the model over this many ranks by tensor "
                       "parallelism, times --expert-parallel (services/engine/split.py); the "
                       "ranks are started here, or joined from an external launcher's RANK / "
                       "WORLD_SIZE / MASTER_ADDR / MASTER_PORT")
    serve.add_argument("--expert-parallel", type=int, default=1,
                       help="DeepSeek V4 / V4.1: split the routed experts over this many ranks, times "
                       "--tensor-parallel")
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
    lay.add_argument("--tensor-parallel", type=int, default=1,
                     help="DeepSeek V4 / V4.1: also print what one rank of an engine split this "
                     "many ways by tensor parallelism holds (docs/design.md §15)")
    lay.add_argument("--expert-parallel", type=int, default=1,
                     help="DeepSeek V4 / V4.1: also print what one rank of an engine split this "
                     "many ways by expert parallelism (the routed experts) holds, alone or times "
                     "--tensor-parallel")
    add_engine_args(lay)
    lay.set_defaults(func=_layout)



def _serve(args) -> int:
    import torch

    from kvmesh.services.engine import split
    from kvmesh.services.engine.rpc.server import serve

    if args.tensor_parallel * args.expert_parallel > 1:
        from torch.multiprocessing.spawn import ProcessException

        from kvmesh.services.engine import ranks
        try:
            return split.serve(args, args.tensor_parallel, args.expert_parallel)
        except ValueError as exc:
            print(f"kvmesh engine: {exc}", file=sys.stderr)
            return 2
        except ProcessException as exc:      # a rank failed or died; the others are ended
            print(f"kvmesh engine: {ranks.failure(exc)}", file=sys.stderr)
            return 1
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


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def _budget(text: str) -> int:
    """--memory: '80GiB', '512MB', '1.5GiB', '1000000' -> bytes."""
    import argparse
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(
            f"memory budget {text!r}: use a byte count or a size like 80GiB, 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _layout(args) -> int:
    if args.tensor_parallel * args.expert_parallel > 1 and not (args.model or args.config):
        print("kvmesh engine layout: --tensor-parallel / --expert-parallel need a DeepSeek V4 "
              "or V4.1 --model or --config", file=sys.stderr)
        return 2
    if not args.config:
        try:
            choose_model(args)
        except ValueError as exc:
            print(f"kvmesh engine layout: {exc}", file=sys.stderr)
            return 2
    return _v4_layout(args)


def _v4_layout(args) -> int:
    from kvmesh.checkpoint_dir import is_v41
    from kvmesh.services.engine.model.deepseek_v4 import layout as v4_layout
    from kvmesh.services.engine.model.deepseek_v4 import v41_layout, window_rows
    from kvmesh.services.engine.model.deepseek_v4.config import read_config
    from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
    from kvmesh.services.engine.model.deepseek_v4.v41_config import read_v41_config

    if args.model and args.config:
        print("kvmesh engine layout: give --model or --config, not both", file=sys.stderr)
        return 2
    path = args.model or args.config
    rows_format = window_rows.for_dtype(args.dtype)
    try:
        if is_v41(path):
            layout_module = v41_layout
            import torch

            from kvmesh.services.engine.model.deepseek_v4.v41_forward import wide
            cfg = read_v41_config(path)
            report = v41_layout.report(cfg, extra_state=bool(args.extra_state),
                                       memory=args.memory, rows_format=rows_format,
                                       state_dtype=wide(getattr(torch, args.dtype)))
        else:
            layout_module = v4_layout
            cfg = read_config(path)
            report = v4_layout.report(cfg, extra_state=bool(args.extra_state),
                                      memory=args.memory, rows_format=rows_format)
        if args.tensor_parallel * args.expert_parallel > 1:
            report["ranks"] = _ranks(cfg, args)
    except (CheckpointError, ValueError) as exc:
        print(f"kvmesh engine layout: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2) if args.json else layout_module.table(report)
    if not args.json and report.get("ranks"):
        r = report["ranks"]
        text += (f"\nranks: tensor-parallel {r['tensor_parallel']} x expert-parallel "
                 f"{r['expert_parallel']}: weights {r['weight_bytes_per_rank']:,} B a rank "
                 f"({r['weight_bytes_whole']:,} B whole, {r['weight_itemsize']} B a value); "
                 "the ledgers above are the same on every rank")
    print(text)
    return 0


def _ranks(cfg, args) -> dict:
    """One rank's share of a split engine (parallel.rank_report)."""
    import torch

    from kvmesh.services.engine.model.deepseek_v4.parallel import rank_report

    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    return rank_report(cfg, args.tensor_parallel, args.expert_parallel, itemsize)
