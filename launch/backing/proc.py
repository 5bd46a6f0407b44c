"""Start, watch and stop a local child process; find free ports; wait for a port."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000            # below: well-known and registered services
_port_lock = threading.Lock()
_next_port: int | None = None


def _pick_range() -> tuple[int, int] | None:
    """[lo, hi) below the kernel's ephemeral range, or None when that range starts too low.

    A port from bind(0) is ephemeral: between our probe and the child's bind, any
    outgoing connection or any other process's bind(0) may be handed the same port
    (CI lost a weed S3 listener that way). The kernel never hands out ports below
    the ephemeral range by itself."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (_LOWEST, low) if low - _LOWEST >= 1000 else None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now, outside the ephemeral range.

    Each process walks the range upward from a random start, so it never hands out
    the same port twice and two processes (pytest-xdist workers) rarely meet."""
    global _next_port
    span = _pick_range()
    if span is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    lo, hi = span
    with _port_lock:
        if _next_port is None or not lo <= _next_port < hi:
            _next_port = random.randrange(lo, hi)
        for _ in range(hi - lo):
            port = _next_port
            _next_port = lo + (port + 1 - lo) % (hi - lo)
            if _bindable(port):
                return port
    raise OSError(f"no free TCP port in [{lo}, {hi})")


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

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None,
                 cwd: Path | None = None):
        self.name = name
        self.cwd = cwd
        self.argv = argv
        self.log_path = Path(log_dir) / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._log_start = 0

    def start(self) -> ManagedProcess:
        log = open(self.log_path, "ab")
        self._log_start = log.seek(0, os.SEEK_END)  # a restart appends to the same log
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(self.env or {})},
            cwd=self.cwd,
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

    def logged(self, text: str) -> str | None:
        """The first line this run (since the last start) logged with `text` in it, or None."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                out = f.read().decode(errors="replace")
        except FileNotFoundError:
            return None
        return next((line for line in out.splitlines() if text in line), None)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""
