"""`kvmesh up`: run the whole mesh locally until Ctrl-C (or, with --demo, for one request).

The launcher logic lives in `kvmesh.launch.mesh.Mesh` (tests use it too); this
file only adds the terminal: progress while starting, a table of endpoints,
the demo request, and a clean stop on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.auth import check_public_bind
from kvmesh.errors import InvalidArgument
from kvmesh.launch.mesh import Mesh, MeshConfig
from kvmesh.running import (
    RUNNING_MESH_FILE,
    AlreadyRunning,
    claim,
    release,
    remove_running,
    write_running,
    write_tokens,
)
from kvmesh.shipped import DEFAULT_MODEL
from kvmesh.tls import TlsFiles
from kvmesh.tls import add_flags as add_tls_flags

# A Python snippet the shipped model (trained on the standard library) continues: long
# enough to fill two 128-token cache blocks whether the tokenizer is byte-level or BPE.
# The gateway's /metrics under `kvmesh up` (the Kubernetes manifests' port); the other
# services' follow it (MeshConfig.metrics_port).
METRICS_PORT = 9100

DEMO_PROMPT = '''import os
import sys


class ConfigError(Exception):
    """Raised when a configuration file cannot be read."""


def read_config(path):
    """Return the key = value pairs of the file at path as a dict.

    Blank lines and lines starting with '#' are skipped.
    """
    if not os.path.exists(path):
        raise ConfigError("no such file: %s" % path)
    config = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise ConfigError("%s:%d: expected key = value" % (path, number))
            config[key.strip()] = value.strip()
    return config


def write_config(path, config):
    """Write the dict config to the file at path, one key = value per line."""
    with open(path, "w", encoding="utf-8") as f:
        for key in sorted(config):
            f.write("%s = %s\\n" % (key, config[key]))


def merge(base, override):
    """Return a new dict with the keys of base, updated from override."""
    result = dict(base)
    result.update(override)
    return result
'''
# Sent second: extends the first prompt, so its first full blocks come from cache.
DEMO_FOLLOW_UP = '''

def main(argv):
    if len(argv) != 2:
        sys.exit("usage: prog FILE")
    config = read_config('''

# Seeded sampling, not greedy: the small shipped model's greedy continuation of code soon
# repeats a line over and over; sampled, it writes varied Python-shaped text. Same seed, same text.
DEMO_TEMPERATURE = 0.8
DEMO_SEED = 1
DEMO_TOKENS = 32
# Asked third, through the OpenAI-compatible HTTP API (greedy: an answer, not a sample). The
# default model learned the chat turns from the standard library's docstrings.
DEMO_QUESTION = "What does the function `os.path.join` do?"
DEMO_ANSWER_TOKENS = 48


def register(sub) -> None:
    up = sub.add_parser("up", help="start the whole mesh locally (Ctrl-C stops it)")
    up.add_argument("--num-engines", type=int, default=2, help="number of engines")
    up.add_argument("--gateway-port", type=int, default=7000,
                    help="gateway gRPC port; 0 = a free port")
    up.add_argument("--http-port", type=int, default=8000,
                    help="gateway OpenAI-compatible HTTP API port; 0 = a free port, -1 = off")
    up.add_argument("--metrics-port", type=int, default=METRICS_PORT,
                    help="the gateway's /metrics port; the directory, kvstores and engines "
                    "take the ports after it, in that order (docs/metrics.md); 0 = a free "
                    "port for each")
    up.add_argument("--log-dir", default=".kvmesh/logs",
                    help="service logs, SeaweedFS and kvstore data")
    up.add_argument("--num-kvstores", type=int, default=1,
                    help="kvstore replicas over the same shard locations and one shared index "
                    "in the mesh's Valkey; engines spread over them (default 1)")
    up.add_argument("--model", default="",
                    help="a DeepSeek V4 or V4.1 checkpoint directory the engines serve; the "
                    "gateway uses its tokenizer.json and chat encoding (default: the shipped "
                    "models/deepseek-v41-tiny; docs/deepseek-v4.md)")
    up.add_argument("--tokenizer", default="",
                    help="tokenizer.json for every engine and the gateway (default: the "
                    "--model checkpoint's)")
    up.add_argument("--dtype", default="", choices=["", "float32", "float64"],
                    help="every engine's weights and activations (default: the engine's, "
                    "float32)")
    up.add_argument("--device", default="",
                    help="every engine's device: auto | cpu | cuda | cuda:N (default: the "
                    "engine's, auto)")
    up.add_argument("--speculative", default="",
                    help="every engine's speculative decoding: off | ngram:K | mtp:K (default: "
                    "the engine's, off)")
    for flag, what in (("--tensor-parallel", "by tensor parallelism"),
                       ("--expert-parallel", "by expert parallelism (routed experts)")):
        up.add_argument(flag, type=int, default=1, help=f"split every engine's model {what} over "
                        "this many ranks, times the other (docs/deepseek-v4.md)")
    up.add_argument("--truncation", default="auto",
                    choices=["auto", "off", "mask", "compact"],
                    help="every engine's YOCO prefill truncation: consumer layers prefill only "
                    "the last --keep-tokens prompt tokens (auto: compact on V4.1 models, off "
                    "on DeepSeek V4; docs/engine/prefix-reuse.md)")
    up.add_argument("--keep-tokens", type=int, default=134,
                    help="KEEP for --truncation mask | compact, at least W + B = 134")
    up.add_argument("--restart", action="store_true", help="start a service that exits "
                    "again, on its port (default: off, its exit is reported and it stays down)")
    up.add_argument("--num-slots", type=int, default=32, help="state slots per engine: "
                    "requests each runs at once (engine serve's default)")
    up.add_argument("--num-blocks", type=int, default=1024,
                    help="128-token cache blocks per engine (engine serve's default)")
    up.add_argument("--pd", action="store_true",
                    help="prefill/decode disaggregation: engine-a prefills (--role prefill), "
                    "the other engines decode (--role decode); with the default --num-engines "
                    "that is 1 prefill + 2 decode engines")
    up.add_argument("--demo", action="store_true",
                    help=f"stream two requests through the gateway ({DEMO_TOKENS} tokens each, "
                    f"sampled at temperature {DEMO_TEMPERATURE} with seed {DEMO_SEED}; the second "
                    "extends the first, so its usage shows cached tokens), ask one question "
                    "through /v1/chat/completions (temperature 0), then stop the mesh and exit 0")
    up.add_argument("--prompt", default=DEMO_PROMPT,
                    help=f"first prompt for --demo (default: a {len(DEMO_PROMPT.encode())}-byte "
                    "Python snippet the shipped model continues)")
    up.add_argument("--api-keys", default="",
                    help="gateway API keys file ('key tenant role' lines); default none: "
                    "gateway auth off, which kvmesh up allows on loopback only")
    up.add_argument("--host", default="127.0.0.1",
                    help="address of the gateway's gRPC, HTTP and metrics ports (every other "
                    "service and backing server always listens on 127.0.0.1); beyond loopback "
                    "it needs --api-keys or --allow-unauthenticated")
    up.add_argument("--allow-unauthenticated", action="store_true",
                    help="let --host be a non-loopback address without --api-keys")
    add_tls_flags(up)
    up.add_argument("--plaintext", action="store_true",
                    help="no TLS between the services (default: mutual TLS with a CA made for "
                    "the run; --tls-* files: TLS on every port with those)")
    up.set_defaults(func=run_up)


class _Stop(Exception):
    """Raised in the main thread by SIGTERM so `finally` stops the mesh."""


def _on_sigterm(signum, frame):
    raise _Stop()


def endpoint_table(mesh: Mesh) -> Table:
    table = Table(title="kvmesh is up", caption=f"logs in {mesh.cfg.log_dir}/")
    table.add_column("service")
    table.add_column("endpoint")
    table.add_column("pid", justify="right")
    table.add_column("log")
    if mesh.valkey is not None:
        table.add_row("valkey", mesh.endpoints["valkey"], str(mesh.valkey.proc.proc.pid),
                      f"valkey/{mesh.valkey.proc.log_path.name}")
    if mesh.seaweed is not None:
        table.add_row("seaweedfs (S3, 12 buckets)", mesh.endpoints["seaweedfs"], "", "seaweedfs/")
    for name, proc in mesh.procs.items():
        table.add_row(name, mesh.endpoints[name], str(proc.proc.pid), proc.log_path.name)
    for name, url in mesh.endpoints.items():
        if name.endswith("-metrics"):
            table.add_row(f"{name[:-8]} /metrics", url, "", "")
    if "gateway-http" in mesh.endpoints:
        table.add_row("gateway HTTP (OpenAI API)", mesh.endpoints["gateway-http"] + "/v1", "", "")
    return table


def address_lines(mesh: Mesh) -> list[str]:
    """Where to point clients and admin commands (printed under the table)."""
    key = " --api-key KEY" if mesh.cfg.api_keys else ""       # KEY: one of the keys file's
    lines = [f"gateway gRPC: {mesh.gateway}    kvmesh generate \"Hello\" --gateway {mesh.gateway}{key}"]
    if "gateway-http" in mesh.endpoints:
        url = mesh.endpoints["gateway-http"]
        auth = " -H 'authorization: Bearer KEY'" if mesh.cfg.api_keys else ""
        lines.append(f"OpenAI-compatible HTTP API: {url}/v1    curl{auth} {url}/v1/models")
    kv = mesh.endpoints["kvstore"]
    found = Path(mesh.cfg.log_dir).parent / "running.json" == Path(RUNNING_MESH_FILE)
    lines.append(f"kvstore admin: {kv}    kvmesh admin --kvstore {kv} gc stats   " + (
        "(run from this directory, `kvmesh admin gc stats` finds it)" if found
        else f"(or export KVMESH_KVSTORE_ADDR={kv})"))
    lines.append("auth: gateway API keys " + (
        f"required (KEY: a key of {mesh.cfg.api_keys}; or export KVMESH_API_KEY=KEY)"
        if mesh.cfg.api_keys else
        "OFF (every service listens on 127.0.0.1 only; --api-keys FILE turns them on)"
        if mesh.cfg.public_host == "127.0.0.1" else "OFF on a public address "
        "(--allow-unauthenticated)") +
        "; internal RPCs need this run's random service token, which `kvmesh admin` "
        "finds by itself (kvmesh/running.py)")
    if mesh.s3_keys is not None:
        lines.append("backing servers: Valkey (ACL user kvmesh) and S3 need this run's random "
                     "credentials, given only to the directory and the kvstore")
    if not mesh.tls.server_enabled:
        lines.append("TLS: OFF (--plaintext): traffic between the services is readable on this "
                     "machine, and a process that takes a kvstore's or directory's port after "
                     "it dies receives what is sent there (never the service token: services "
                     "send one-call proofs of it; the gateway asks an engine who it is first)")
    elif not mesh.cfg.tls_public:
        lines.append(f"TLS: mutual TLS between the services, with a CA made for this run "
                     f"({Path(mesh.tls.ca).parent}/); the gateway's gRPC and HTTP ports are "
                     f"plaintext (callers authenticate with API keys)")
    else:
        lines.append(("TLS: mutual TLS on every gRPC port (clients need a certificate of the "
                      "CA)" if mesh.tls.mutual else "TLS on every gRPC port")
                     + "; HTTPS on the HTTP API")
    return lines


def run_up(args: argparse.Namespace) -> int:
    # Endpoints must not wrap mid-address: never narrower than the table needs.
    console = Console(stderr=True, width=max(Console(stderr=True).width, 100))
    try:  # before anything starts: a refused bind should not cost a minute of start-up
        check_public_bind(args.host, bool(args.api_keys), args.allow_unauthenticated)
    except InvalidArgument as exc:
        console.print(f"[red]kvmesh up:[/red] {exc}", highlight=False)
        return 2
    try:
        claimed = claim(args.log_dir)
    except AlreadyRunning as exc:
        console.print(f"[red]kvmesh up:[/red] {exc}", highlight=False)
        return 1
    try:
        return _run(args, console)
    finally:
        release(claimed)


def with_run_tls(cfg: MeshConfig, args: argparse.Namespace) -> MeshConfig:
    """Mutual TLS between the services with a CA made for this run (in LOG_DIR/tls), the
    gateway's public ports plaintext: the default. --tls-* files given: those, on every
    port. --plaintext: none (the banner says what that risks)."""
    if getattr(args, "plaintext", False):
        return replace(cfg, tls=TlsFiles())
    if TlsFiles.from_env().server_enabled:          # --tls-cert / $KVMESH_TLS_CERT
        return cfg
    from kvmesh.run_ca import make_run_ca

    return replace(cfg, tls=make_run_ca(Path(args.log_dir) / "tls"), tls_public=False)


def _run(args: argparse.Namespace, console: Console) -> int:
    cfg = with_run_tls(mesh_config(args), args)
    signal.signal(signal.SIGTERM, _on_sigterm)
    status = console.status("starting kvmesh ...")
    mesh = Mesh(cfg, on_progress=lambda name, state: status.update(f"{name}: {state} ..."))
    running = tokens = None
    try:
        with status:
            mesh.start()
        # Beside the logs: with the default --log-dir, .kvmesh/running.json, where
        # `kvmesh admin` looks for the kvstore (kvmesh/running.py).
        running = write_running(mesh.endpoints, Path(args.log_dir).parent / "running.json",
                                service_pids(mesh))
        # `kvmesh admin` beside it takes the tokens and, under the run's CA, its TLS files
        tokens = write_tokens(mesh.endpoints, {"KVMESH_SERVICE_TOKEN": cfg.service_token,
                                               "KVMESH_ADMIN_TOKEN": cfg.admin_token,
                                               **mesh.tls.env()})
        console.print(endpoint_table(mesh))
        for line in address_lines(mesh):
            console.print(line, highlight=False, soft_wrap=True)
        if args.demo:
            code = asyncio.run(_demo(mesh.gateway, args.prompt, console))
            if code == 0 and "gateway-http" in mesh.endpoints:
                code = _demo_chat(mesh.endpoints["gateway-http"], console)
            return code
        console.print("kvmesh is running (Ctrl-C stops the mesh)")
        supervise(mesh, console, getattr(args, "restart", False),
                  lambda: write_running(mesh.endpoints, running, service_pids(mesh)))
        # until SIGINT (KeyboardInterrupt) or SIGTERM (_Stop)
    except (KeyboardInterrupt, _Stop):
        console.print("stopping kvmesh ...")
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]kvmesh up failed:[/red] {exc}")
        return 1
    finally:
        if running is not None:
            remove_running(running)
        if tokens is not None:
            tokens.unlink(missing_ok=True)
        mesh.stop()
        console.print("kvmesh stopped")
    return 0


def service_pids(mesh: Mesh) -> dict[str, int]:
    return {name: mesh.pid(name) for name in mesh.procs}


def supervise(mesh: Mesh, console: Console, restart: bool, on_restart=lambda: None,
              every_s: float = 0.5, stop: threading.Event | None = None) -> None:
    """Watch the mesh's processes until `stop` (or forever): one that exits is reported
    at once (name, exit status, its last log lines) and, with `restart`, started again on
    the same port (`on_restart` then runs, e.g. to rewrite running.json)."""
    reported: set[str] = set()
    while stop is None or not stop.is_set():
        for name, proc in list(mesh.procs.items()):
            if proc.alive:        # (alive polls the child: an exited one is reaped at once)
                reported.discard(name)
                continue
            if name in reported:
                continue
            reported.add(name)
            console.print(f"[red]{name} exited with status {proc.proc.returncode}[/red]; its "
                          f"last log lines:\n{proc.tail(10)}", highlight=False)
            if not restart:
                continue
            console.print(f"restarting {name} ...", highlight=False)
            try:
                mesh.restart(name)
            except (RuntimeError, TimeoutError) as exc:
                console.print(f"[red]{name} did not come back:[/red] {exc}", highlight=False)
                continue
            reported.discard(name)
            on_restart()
            console.print(f"{name} is back (pid {mesh.pid(name)})", highlight=False)
        time.sleep(every_s)


def engine_model(flag: str) -> str:
    """--model as MeshConfig.model takes it: the checkpoint directory, the shipped one by
    default."""
    return flag or str(DEFAULT_MODEL)


def mesh_config(args: argparse.Namespace) -> MeshConfig:
    """The MeshConfig `kvmesh up`'s flags ask for, with fresh random internal tokens."""
    pd = getattr(args, "pd", False)
    engines = 3 if pd and args.num_engines == 2 else args.num_engines   # --pd: 1 PE + 2 CEs by default
    return MeshConfig(engines=engines, pd=pd, gateway_port=args.gateway_port,
                      http_port=args.http_port, metrics_port=args.metrics_port,
                      log_dir=Path(args.log_dir), num_slots=args.num_slots,
                      num_blocks=args.num_blocks, kvstores=args.num_kvstores,
                      model=engine_model(getattr(args, "model", "")),
                      **{k: getattr(args, k, "") for k in ("tokenizer", "dtype", "device",
                                                           "speculative")},
                      tensor_parallel=getattr(args, "tensor_parallel", 1),
                      expert_parallel=getattr(args, "expert_parallel", 1),
                      truncation=getattr(args, "truncation", "auto"),
                      keep_tokens=getattr(args, "keep_tokens", 134),
                      # Fresh random tokens per run: internal RPCs refuse anyone without them.
                      service_token=secrets.token_urlsafe(32),
                      admin_token=secrets.token_urlsafe(32),
                      api_keys=args.api_keys, public_host=args.host,
                      allow_unauthenticated=args.allow_unauthenticated,
                      # Valkey and S3 with random credentials only the mesh's processes get.
                      lock_backing=True)


def _demo_chat(url: str, console: Console) -> int:
    """One question through the OpenAI-compatible API, as any OpenAI client would ask it."""
    import json
    import urllib.request

    console.print(f"[bold]demo 3/3[/bold]: POST {url}/v1/chat/completions (temperature 0, "
                  f"{DEMO_ANSWER_TOKENS} tokens at most)")
    console.print(f"user: {DEMO_QUESTION}", style="dim", markup=False, highlight=False)
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
            model = json.load(resp)["data"][0]["id"]
        body = {"model": model, "max_tokens": DEMO_ANSWER_TOKENS, "temperature": 0,
                "messages": [{"role": "user", "content": DEMO_QUESTION}]}
        request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            reply = json.load(resp)
    except OSError as exc:     # an HTTP error status is one
        console.print(f"[red]chat request failed:[/red] {exc}", highlight=False)
        return 1
    answer = reply["choices"][0]["message"]["content"]
    print("assistant: " + "".join(c if c.isprintable() or c in "\n\t" else
                                  c.encode("unicode_escape").decode("ascii") for c in answer))
    u = reply["usage"]
    console.print(f"usage: prompt={u['prompt_tokens']} completion={u['completion_tokens']} "
                  f"finish={reply['choices'][0]['finish_reason']}")
    return 0


async def _demo(gateway: str, prompt: str, console: Console) -> int:
    """Two requests: the second extends the first, so the usage line shows cache reuse."""
    from kvmesh.services.gateway.client import GatewayClient

    async with GatewayClient(gateway) as gw:
        for i, text in enumerate((prompt, prompt + DEMO_FOLLOW_UP)):
            console.print(f"[bold]demo {i + 1}/3[/bold]: GenerateStream via {gateway} "
                          f"(temperature {DEMO_TEMPERATURE}, seed {DEMO_SEED}, {DEMO_TOKENS} tokens, "
                          f"{len(text.encode())}-byte prompt)")
            # The prompt dimmed, then the model's continuation as it streams in.
            console.print(text, style="dim", end="", markup=False, highlight=False,
                          soft_wrap=True)
            last = None
            # ignore_eos: the demo always shows 32 tokens (the usage line is checked by tests).
            async for msg in gw.stream(text, max_tokens=DEMO_TOKENS, temperature=DEMO_TEMPERATURE,
                                       seed=DEMO_SEED, timeout=60, ignore_eos=True):
                # A model may write any text: control characters other than newline and
                # tab are shown escaped.
                sys.stdout.write("".join(c if c.isprintable() or c in "\n\t" else
                                         c.encode("unicode_escape").decode("ascii")
                                         for c in msg.text))
                sys.stdout.flush()
                last = msg
            u = last.usage
            print()
            console.print(f"usage: prompt={u.prompt_tokens} cached={u.cached_tokens} "
                          f"replayed={u.replayed_tokens} generated={u.generated_tokens} "
                          f"engine={last.engine_id}")
    return 0
