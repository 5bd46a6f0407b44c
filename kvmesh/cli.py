"""The `kvmesh` command.

Each service module that offers commands exposes `register(subparsers)`; this
file only collects them, so commands live next to the code they drive.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvmesh.clihelp import DefaultsFormatter, walk
from kvmesh.tls import export_flags as export_tls_flags

# Modules that add sub-commands, in the order they appear in --help.
COMMAND_MODULES = [
    "services.engine.cli",       # kvmesh generate --local, kvmesh engine serve
    "services.gateway.cli",      # kvmesh generate, kvmesh gateway serve
    "services.kvstore.cli",      # kvmesh kvstore serve, kvmesh admin ...
    "services.directory.cli",    # kvmesh directory serve
    "kvmesh.mesh",               # kvmesh up
    "services.engine.train.cli", # kvmesh train, kvmesh train-eval
    "services.engine.score_cli", # kvmesh score (DeepSeek V4 checkpoints)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--log-level", default="INFO",
                        help="DEBUG, INFO, WARNING or ERROR (logs go to stderr)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency, not an absent module
                raise
            continue
        module.register(sub)
    for p in walk(parser):  # every flag's help shows its default (kvmesh/clihelp.py)
        p.formatter_class = DefaultsFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    export_tls_flags(args)  # --tls-* reach every channel and server of this process
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
