"""Mesh: start the whole kvmesh as local processes, wait until healthy, stop it cleanly.

Used by `kvmesh up` and by tests (one mesh per test module):

    valkey, seaweedfs (12 buckets = 12 shard locations) -> kvstore
           -> directory -> engine-a, engine-b (in parallel) -> gateway

Each service is a real subprocess on a loopback port (a free one unless
configured) with its log in `<log_dir>/<name>.log`; "healthy" means the gRPC
health check answers SERVING. `Mesh` owns every child process it started and
stops them in reverse order (SIGTERM to the process group, SIGKILL after a
grace period), so nothing outlives `stop()`.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.checkpoint_dir import is_v41
from kvmesh.healthcheck import check as health_check
from kvmesh.launch.backing.proc import ManagedProcess, free_port, port_open
from kvmesh.launch.backing.valkey import ValkeyProcess
from kvmesh.s3 import S3Keys
from kvmesh.shipped import DEFAULT_MODEL
from kvmesh.tls import PUBLIC_ENV, TlsFiles

log = logging.getLogger("kvmesh.launch.up")
KVMESH = [sys.executable, "-m", "kvmesh.launch.cli"]


@dataclass(frozen=True)
class MeshConfig:
    engines: int = 2
    gateway_port: int = 0            # 0 = a free port (kvmesh up uses 7000)
    # /metrics: the gateway's port, then one each for the directory, kvstores and engines;
    # 0 = a free port for each
    metrics_port: int = 0
    http_port: int = 0               # gateway OpenAI-compatible HTTP API; 0 = a free port, -1 = off
    log_dir: Path = Path(".kvmesh/logs")
    # The checkpoint directory the engines serve (--model): the shipped default unless
    # given. The gateway tokenizes with its tokenizer.json and renders its chat encoding.
    model: str = str(DEFAULT_MODEL)
    # Engine settings every engine gets (`kvmesh up` flags of the same names); "" = the
    # engine's default. tokenizer goes to the gateway too (its routing keys, chat template).
    tokenizer: str = ""
    dtype: str = ""
    device: str = ""
    speculative: str = ""
    # Every engine split over tensor x expert ranks (engine serve's flags; docs/deepseek-v4.md)
    tensor_parallel: int = 1
    expert_parallel: int = 1
    # YOCO prefill truncation, given to every engine explicitly (the design wants KEEP
    # explicit): "auto" = compact with KEEP = W + B = 134 where the model has consumer
    # layers to truncate (V4.1), off for DeepSeek V4.
    truncation: str = "auto"
    keep_tokens: int = 134
    num_slots: int = 8
    num_blocks: int = 512
    engine_extra: tuple[str, ...] = ()
    gateway_extra: tuple[str, ...] = ()
    # Two cores run several torch processes in tests: one thread each.
    env: dict = field(default_factory=lambda: {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    start_timeout_s: float = 90.0
    # Auth (kvmesh/auth.py). "" = off, the default for tests; `kvmesh up` passes random
    # tokens. Every process gets them through its environment, never on a command line.
    service_token: str = ""          # KVMESH_SERVICE_TOKEN: internal RPCs
    admin_token: str = ""            # KVMESH_ADMIN_TOKEN: kvstore Delete/RunGC/Scrub
    api_keys: str = ""               # gateway keys file (--api-keys); "" = gateway auth off
    # The gateway's gRPC/HTTP/metrics address; every other process listens on 127.0.0.1.
    # Beyond loopback the gateway itself refuses to start without api_keys unless allowed.
    public_host: str = "127.0.0.1"
    allow_unauthenticated: bool = False
    # Lock the backing servers with fresh random credentials (`kvmesh up`): Valkey's
    # ACL user and password go to the directory only, the S3 keys to the kvstore only.
    lock_backing: bool = False
    # Certificates for every gRPC server and client, HTTPS on the HTTP API (kvmesh/tls.py);
    # None = whatever $KVMESH_TLS_* says in this process (children inherit it).
    tls: TlsFiles | None = None
    # False: the gateway's public gRPC and HTTP ports serve plaintext while every internal
    # port and channel keeps `tls` (`kvmesh up`: mutual TLS with a per-run CA inside, API
    # keys outside; KVMESH_TLS_PUBLIC in kvmesh/tls.py).
    tls_public: bool = True
    # Prefill/decode disaggregation: engine-a is a prefill engine, the others decode
    # engines (`kvmesh up --pd`: 1 + 2); the decode engines are also the gateway's fallback.
    pd: bool = False
    # kvstore replicas over the same 12 locations and one shared index in the mesh's
    # Valkey (`kvmesh up --num-kvstores N`); engines spread over them (`--kvstore a,b`).
    kvstores: int = 1

    def __post_init__(self):
        if not 1 <= self.kvstores <= 8:
            raise ValueError(f"kvstores must be in [1, 8], got {self.kvstores}")
        if not 1 <= self.engines <= 26:
            raise ValueError(f"engines must be in [1, 26], got {self.engines}")
        if self.pd and self.engines < 2:
            raise ValueError("pd needs at least 2 engines (1 prefill + decode engines)")

    def role(self, index: int) -> str:
        """The role of the index-th engine (engine-a = 0)."""
        if not self.pd:
            return "unified"
        return "prefill" if index == 0 else "decode"


def engine_argv(cfg: MeshConfig, engine_id: str, port: int, directory: str, kvstore: str,
                role: str = "unified") -> list[str]:
    """The one place that decides how engines are launched."""
    model = ["--model", cfg.model or str(DEFAULT_MODEL)]
    given = [(flag, value) for flag, value in (
        ("--tokenizer", cfg.tokenizer), ("--dtype", cfg.dtype), ("--device", cfg.device),
        ("--speculative", cfg.speculative),
        ("--tensor-parallel", str(cfg.tensor_parallel) if cfg.tensor_parallel > 1 else ""),
        ("--expert-parallel", str(cfg.expert_parallel) if cfg.expert_parallel > 1 else ""))
        if value]
    return [*KVMESH, "engine", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--engine-id", engine_id, "--directory", directory, "--kvstore", kvstore,
            *model, "--num-slots", str(cfg.num_slots), "--num-blocks", str(cfg.num_blocks),
            "--role", role, *[x for pair in given for x in pair], *truncation_flags(cfg),
            *cfg.engine_extra]


def truncation_flags(cfg: MeshConfig) -> list[str]:
    """The engines' --truncation and --keep-tokens for cfg.truncation ("auto": see
    MeshConfig)."""
    mode = cfg.truncation
    if mode == "auto":
        mode = "compact" if not cfg.model or is_v41(cfg.model) else "off"
    if mode == "off":
        return ["--truncation", "off"]
    return ["--truncation", mode, "--keep-tokens", str(cfg.keep_tokens)]


def kvstore_argv(port: int, locations: list[str], data_dir: Path, index: str = "sqlite",
                 replica: str = "") -> list[str]:
    return [*KVMESH, "kvstore", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--locations", ",".join(locations), "--data-dir", str(data_dir),
            "--index", index, *(("--replica", replica) if replica else ())]


class Mesh:
    """Processes of one mesh. `start()` -> `endpoints` -> `kill(name)` -> `stop()`."""

    def __init__(self, cfg: MeshConfig | None = None,
                 on_progress: Callable[[str, str], None] | None = None):
        self.cfg = cfg or MeshConfig()
        self.on_progress = on_progress or (lambda name, state: None)
        self.procs: dict[str, ManagedProcess] = {}
        self.endpoints: dict[str, str] = {}        # name -> host:port (or URL)
        self.valkey: ValkeyProcess | None = None
        self.seaweed = None
        env = dict(self.cfg.env)
        if self.cfg.service_token:
            env["KVMESH_SERVICE_TOKEN"] = self.cfg.service_token
        if self.cfg.admin_token:
            env["KVMESH_ADMIN_TOKEN"] = self.cfg.admin_token
        self.tls = self.cfg.tls if self.cfg.tls is not None else TlsFiles.from_env()
        env.update(self.tls.env())
        self.env = env  # what every child process gets on top of os.environ
        self._own_env: dict[str, dict[str, str]] = {}  # name -> what only that one gets
        # Made per run, never written to config, logs or command lines (see _start_all).
        self.redis_user = self.redis_password = ""
        self.s3_keys: S3Keys | None = None
        if self.cfg.lock_backing:
            self.redis_user, self.redis_password = "kvmesh", secrets.token_urlsafe(30)
            self.s3_keys = S3Keys.generate()

    @property
    def public_tls(self) -> TlsFiles:
        """What the gateway's public ports serve (and a user's client dials)."""
        return self.tls if self.cfg.tls_public else TlsFiles()

    @property
    def kvstore_names(self) -> list[str]:
        """kvstore (the admin address), then kvstore-b, kvstore-c, ..."""
        return ["kvstore"] + [f"kvstore-{chr(ord('a') + i)}" for i in range(1, self.cfg.kvstores)]

    @property
    def engine_names(self) -> list[str]:
        return [f"engine-{chr(ord('a') + i)}" for i in range(self.cfg.engines)]

    @property
    def gateway_host(self) -> str:
        """Where local clients reach the gateway: loopback when it listens everywhere."""
        host = self.cfg.public_host
        return "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host

    @property
    def gateway(self) -> str:
        return self.endpoints["gateway"]

    # --- start ---------------------------------------------------------------------
    def start(self) -> Mesh:
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self) -> None:
        cfg, log_dir = self.cfg, Path(self.cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.on_progress("valkey", "starting")
        # persist: the kvstore's live index is in it (appendonly, reloaded next start)
        self.valkey = ValkeyProcess(work_dir=log_dir / "valkey", user=self.redis_user,
                                    password=self.redis_password, persist=True).start()
        self.endpoints["valkey"] = self.valkey.url
        self.on_progress("valkey", "healthy")
        kvstore = self._start_kvstore(log_dir)
        dir_port, dir_metrics = free_port(), self._metrics_port("directory")
        self._spawn("directory", [*KVMESH, "directory", "serve", "--host", "127.0.0.1",
                                  "--port", str(dir_port), "--redis-url", self.valkey.url,
                                  "--key-prefix", f"kvmesh:mesh:{uuid.uuid4().hex[:8]}",
                                  "--metrics-port", str(dir_metrics)], dir_port,
                    own_env={"KVMESH_DIRECTORY_REDIS_USERNAME": self.redis_user,
                             "KVMESH_DIRECTORY_REDIS_PASSWORD": self.redis_password}
                    if self.redis_user else None)
        self.endpoints["directory-metrics"] = f"http://127.0.0.1:{dir_metrics}/metrics"
        self._wait_healthy(["directory"])
        for i, name in enumerate(self.engine_names):
            port, metrics = free_port(), self._metrics_port(name)
            self._spawn(name, [*engine_argv(cfg, name, port, self.endpoints["directory"], kvstore,
                                            cfg.role(i)),
                               "--metrics-port", str(metrics)], port)
            self.endpoints[f"{name}-metrics"] = f"http://127.0.0.1:{metrics}/metrics"
        self._wait_healthy(self.engine_names)
        self.add_gateway("gateway", cfg.api_keys, cfg.gateway_port,
                         self._metrics_port("gateway"), cfg.http_port)

    def _metrics_port(self, name: str) -> int:
        """`metrics_port` 0: a free port per service; else the gateway's, and after it the
        directory's, the kvstores' and the engines', one each in that order (fixed, so a
        Prometheus configuration written once keeps working)."""
        if not self.cfg.metrics_port:
            return free_port()
        order = ["gateway", "directory", *self.kvstore_names, *self.engine_names]
        return self.cfg.metrics_port + order.index(name)

    def add_gateway(self, name: str, api_keys: str = "", port: int = 0, metrics_port: int = 0,
                    http_port: int = 0) -> None:
        """Start a gateway over this mesh's engines and directory, wait until it serves;
        endpoints `name`, `name-metrics`, `name-http`. `start()` starts "gateway"; a
        benchmark may add a second one (auth on beside auth off, same engines)."""
        cfg = self.cfg
        port, metrics_port = port or free_port(), metrics_port or free_port()
        http_port = -1 if http_port < 0 else http_port or free_port()
        self._spawn(name, [*KVMESH, "gateway", "serve", "--host", cfg.public_host,
                           "--port", str(port),
                           "--engines", ",".join(self.endpoints[n] for n in self.engine_names),
                           "--directory", self.endpoints["directory"],
                           "--metrics-port", str(metrics_port), "--http-port", str(http_port),
                           *(("--api-keys", api_keys) if api_keys else ()),
                           *(("--allow-unauthenticated",) if cfg.allow_unauthenticated else ()),
                           *self._pd_args(), *self._tokenizer_args(), *cfg.gateway_extra],
                    port, host=self.gateway_host,
                    own_env=None if cfg.tls_public else {PUBLIC_ENV: "off"})
        self._wait_healthy([name])
        host = self.gateway_host
        self.endpoints[f"{name}-metrics"] = f"http://{host}:{metrics_port}/metrics"
        if http_port > 0:
            self._wait_port(name, host, http_port)
            scheme = "https" if self.public_tls.server_enabled else "http"
            self.endpoints[f"{name}-http"] = f"{scheme}://{host}:{http_port}"

    def _tokenizer_args(self) -> list[str]:
        """The engines' tokenizer: --tokenizer, else a --model checkpoint's tokenizer.json."""
        if self.cfg.tokenizer:
            return ["--tokenizer", self.cfg.tokenizer]
        tokenizer = Path(self.cfg.model) / "tokenizer.json"
        return ["--tokenizer", str(tokenizer)] if self.cfg.model and tokenizer.exists() else []

    def _pd_args(self) -> list[str]:
        if not self.cfg.pd:
            return []
        names = self.engine_names
        return ["--prefill-engines", self.endpoints[names[0]],
                "--decode-engines", ",".join(self.endpoints[n] for n in names[1:])]

    def _start_kvstore(self, log_dir: Path) -> str:
        """One SeaweedFS server with 12 buckets (the 12 shard locations), then the kvstore."""
        from kvmesh.launch.backing.seaweed import start_seaweed_cluster

        self.on_progress("seaweedfs", "starting")
        self.seaweed = start_seaweed_cluster(1, 12, log_dir / "seaweedfs", keys=self.s3_keys)
        self.endpoints["seaweedfs"] = self.seaweed.servers[0].endpoint
        self.on_progress("seaweedfs", "healthy")
        # Every replica on the shared index (kvmesh:kv in the mesh's Valkey, which keeps it
        # on disk); the ACL user's credentials reach them through their environment only.
        own = dict(self.s3_keys.env()) if self.s3_keys else {}
        if self.redis_user:
            own |= {"KVMESH_KVSTORE_REDIS_USERNAME": self.redis_user,
                    "KVMESH_KVSTORE_REDIS_PASSWORD": self.redis_password}
        names = self.kvstore_names
        for name in names:
            port, metrics = free_port(), self._metrics_port(name)
            self._spawn(name, [*kvstore_argv(port, self.seaweed.locations, log_dir / name,
                                             self.valkey.url, name),
                               "--metrics-port", str(metrics)], port, own_env=own or None)
            self.endpoints[f"{name}-metrics"] = f"http://127.0.0.1:{metrics}/metrics"
        self._wait_healthy(names)
        return ",".join(self.endpoints[n] for n in names)

    def _spawn(self, name: str, argv: list[str], port: int, host: str = "127.0.0.1",
               own_env: dict[str, str] | None = None) -> None:
        self.on_progress(name, "starting")
        log.debug("starting %s: %s", name, " ".join(argv))
        self._own_env[name] = own_env or {}
        proc = ManagedProcess(name, argv, Path(self.cfg.log_dir), env=self._env_of(name))
        # Start each run with a fresh log: the tail shown on failure is this run's.
        proc.log_path.unlink(missing_ok=True)
        self.procs[name] = proc.start()
        self.endpoints[name] = f"{host}:{port}"

    def _env_of(self, name: str) -> dict[str, str]:
        return {**self.env, **self._own_env.get(name, {})}

    def _wait_healthy(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        waiting = list(names)
        while waiting:
            for name in list(waiting):
                proc = self.procs[name]
                if not proc.alive:
                    raise RuntimeError(f"{name} exited with {proc.proc.returncode} while starting; "
                                       f"last log lines ({proc.log_path}):\n{proc.tail()}")
                tls = self.public_tls if name.startswith("gateway") else self.tls
                if health_check(self.endpoints[name], timeout=0.5, tls=tls):
                    waiting.remove(name)
                    self.on_progress(name, "healthy")
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(waiting)} not healthy after "
                                   f"{self.cfg.start_timeout_s}s; see {self.cfg.log_dir}")
            if waiting:
                time.sleep(0.1)

    def _wait_port(self, name: str, host: str, port: int) -> None:
        """The gateway opens its HTTP port just after its gRPC one: wait for it too."""
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not port_open(host, port):
            if not self.procs[name].alive or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not open port {port}; last log lines:\n"
                                   f"{self.procs[name].tail()}")
            time.sleep(0.05)

    # --- run time ------------------------------------------------------------------
    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].alive

    def pid(self, name: str) -> int:
        return self.procs[name].proc.pid

    def kill(self, name: str) -> None:
        """SIGKILL one service (tests: an engine dying mid-stream)."""
        self.procs[name].kill()

    def restart(self, name: str) -> None:
        """Stop (if needed) and start one service again on the same port; wait until healthy."""
        old = self.procs[name]
        old.stop()
        self.procs[name] = ManagedProcess(name, old.argv, Path(self.cfg.log_dir),
                                          env=self._env_of(name)).start()
        self._wait_healthy([name])

    def pids(self) -> list[int]:
        out = [p.proc.pid for p in self.procs.values() if p.proc is not None]
        if self.valkey is not None and self.valkey.proc is not None:
            out.append(self.valkey.proc.proc.pid)
        return out

    # --- stop ----------------------------------------------------------------------
    def stop(self) -> None:
        """Stop everything, newest first; safe to call twice or after a failed start."""
        for name in reversed(list(self.procs)):
            self.on_progress(name, "stopping")
            self.procs[name].stop(timeout=10.0)
        if self.seaweed is not None:
            self.seaweed.stop()
        if self.valkey is not None:
            self.valkey.stop()

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

