"""Write docs/usage/configuration.md from the code: every flag of every `kvmesh` command
(from the parsers themselves) and every `KVMESH_*` variable (the config dataclasses' fields
with their defaults, and the variables read one by one, listed below with theirs).

    python scripts/gen_config_doc.py            # rewrite the page
    python scripts/gen_config_doc.py --check    # exit 1 if the page is not what the code says

tests/test_config_doc.py runs --check, and checks that every KVMESH_* name in the code is on
the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = ROOT / "docs" / "usage" / "configuration.md"

# Variables read one at a time (not through a config dataclass): default, meaning.
SINGLE = {
    "KVMESH_GATEWAY_ADDR": ("127.0.0.1:7000", "where `kvmesh generate` and `kvmesh up`'s "
                            "clients find the gateway"),
    "KVMESH_API_KEY": ("none", "the API key `kvmesh generate` and `GatewayClient` send"),
    "KVMESH_KVSTORE_ADDR": ("the running `kvmesh up`'s kvstore", "the kvstore `kvmesh admin` "
                            "talks to"),
    "KVMESH_SERVICE_TOKEN": ("none", "the token services present to each other (kvstore, "
                             "directory); see docs/deployment/security.md"),
    "KVMESH_ADMIN_TOKEN": ("none", "the token `kvmesh admin` presents to a kvstore"),
    "KVMESH_HOME": ("~/.kvmesh", "where `kvmesh up` keeps the tokens it made"),
    "KVMESH_VALKEY_USER": ("kvmesh", "the ACL user of the Valkey that `kvmesh up` starts"),
    "KVMESH_VALKEY_PASSWORD": ("generated", "its password"),
    "KVMESH_KERNELS": ("auto", "the engine's kernels: `torch`, `triton` or `auto`"),
    "KVMESH_CACHE_DIR": ("$XDG_CACHE_HOME/kvmesh", "where compiled CPU kernels are cached"),
}


def _default(action) -> str:
    if action.nargs == 0:
        return "off" if not action.default else "on"
    if action.default in (None, argparse.SUPPRESS, ""):
        return "-"
    return f"`{action.default}`"


def _help(action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%")
    return " ".join(text.split()).replace("|", "\\|")


def flags() -> list[str]:
    from kvmesh.clihelp import walk
    from kvmesh.launch.cli import build_parser

    out = []
    for parser in walk(build_parser()):
        actions = [a for a in parser._actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        out += [f"### `{parser.prog}`", "", "| flag | default | what |", "|---|---|---|"]
        for a in actions:
            names = ", ".join(f"`{o}`" for o in a.option_strings)
            out.append(f"| {names} | {_default(a)} | {_help(a)} |")
        out.append("")
    return out


def _dataclass_vars(cls, prefix: str, names: dict | None = None) -> list[tuple[str, str]]:
    rows = []
    for f in dataclasses.fields(cls):
        name = (names or {}).get(f.name) if names is not None else prefix + f.name.upper()
        if not name:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
        shown = "(secret)" if "password" in f.name else "empty" if default == "" else f"`{default}`"
        rows.append((name, shown))
    return rows


def variables() -> list[tuple[str, str, str]]:
    """(name, default, what) of every KVMESH_* variable the code reads."""
    from kvmesh import envs, tls
    from kvmesh.services.directory.config import ENV_PREFIX as DIR_PREFIX
    from kvmesh.services.directory.config import DirectoryConfig
    from kvmesh.services.engine.config import EngineConfig
    from kvmesh.services.gateway.config import ENV_PREFIX as GW_PREFIX
    from kvmesh.services.gateway.config import GatewayConfig
    from kvmesh.services.kvstore.config import ENV_PREFIX as KV_PREFIX
    from kvmesh.services.kvstore.config import KvstoreConfig

    rows = [(n, d, "`kvmesh engine serve` (and every engine `kvmesh up` starts), the flag "
             f"`--{field.replace('_', '-')}`")
            for field, (n, d) in zip(envs.ENGINE_VARS,
                                     _dataclass_vars(EngineConfig, "", envs.ENGINE_VARS),
                                     strict=True)]
    for cls, prefix, what in ((GatewayConfig, GW_PREFIX, "the gateway"),
                              (DirectoryConfig, DIR_PREFIX, "the directory"),
                              (KvstoreConfig, KV_PREFIX, "the kvstore")):
        rows += [(n, d, f"{what}: the field `{n[len(prefix):].lower()}`")
                 for n, d in _dataclass_vars(cls, prefix) if n != prefix + "LAYOUT"]
    rows += [(n, "none", f"TLS for every process: the {field.replace('_', ' ')} file"
              if field != "server_name" else "TLS: the name clients expect in certificates")
             for field, n in tls.ENV.items()]
    rows.append((tls.PUBLIC_ENV, "none", "`off`: the gateway's public gRPC and HTTP ports "
                 "serve plaintext while its channels keep TLS (`kvmesh up` sets it with its "
                 "per-run CA)"))
    rows.append((tls.HEALTH_PORT_ENV, "none", "a TLS server's plaintext port serving only "
                 "grpc.health.v1, for probes without a client certificate (deploy/k8s: 8086)"))
    rows += [(n, d, what) for n, (d, what) in SINGLE.items()]
    return rows


def render() -> str:
    lines = ["# Configuration", "",
             "Every flag of every `kvmesh` command and every `KVMESH_*` environment variable, "
             "with its default, generated from the code by `scripts/gen_config_doc.py` (a test "
             "keeps this page equal to what the code says).", "",
             "A flag given on the command line wins; then its `KVMESH_*` variable, where it has "
             "one; then the default.", "", "## Environment variables", "",
             "| variable | default | read by |", "|---|---|---|"]
    lines += [f"| `{n}` | {d} | {w} |" for n, d, w in sorted(variables())]
    lines += ["", "## Flags", ""] + flags()
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the page differs from what the code says, instead of writing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/gen_config_doc.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
