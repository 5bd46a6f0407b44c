"""The `kvmesh` command.

Each service module that offers commands exposes `register(subparsers)`; this
file only collects them, so commands live next to the code they drive.
"""

from __future__ import annotations

import argparse
import logging
import sys

import kvmesh.launch.generate
import kvmesh.launch.up
import kvmesh.services.directory.cli
import kvmesh.services.engine.cli
import kvmesh.services.engine.score_cli
import kvmesh.services.gateway.cli
import kvmesh.services.kvstore.cli
import kvmesh.training.cli
from kvmesh.clihelp import DefaultsFormatter, walk
from kvmesh.tls import export_flags as export_tls_flags

# Modules that add sub-commands, in the order they appear in --help. Imported by name, not
# through importlib, so the import-linter sees this launcher's dependencies.
COMMAND_MODULES = [
    kvmesh.launch.generate,              # kvmesh generate (through the gateway, or --local)
    kvmesh.services.engine.cli,          # kvmesh engine serve / layout
    kvmesh.services.gateway.cli,         # kvmesh gateway serve
    kvmesh.services.kvstore.cli,         # kvmesh kvstore serve, kvmesh admin ...
    kvmesh.services.directory.cli,       # kvmesh directory serve
    kvmesh.launch.up,                    # kvmesh up
    kvmesh.training.cli,    # kvmesh train, kvmesh train-eval
    kvmesh.services.engine.score_cli,    # kvmesh score (DeepSeek V4 checkpoints)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--log-level", default="INFO",
                        help="DEBUG, INFO, WARNING or ERROR (logs go to stderr)")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
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
