"""Start, watch and stop a local child process; find free ports; wait for a port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def wait_port(host: str, port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before opening port {port}")
        time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} did not open within {timeout}s")


class ManagedProcess:
    """One child process with its output in a log file; stop() is idempotent.

    The child gets its own process group so stop() also ends what it spawned.
    """

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.argv = argv
        self.log_path = Path(log_dir) / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> ManagedProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(self.env or {})},
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
        if not self.alive:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.stop(timeout=5.0, sig=signal.SIGKILL)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""
