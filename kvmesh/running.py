"""The running `kvmesh up`'s endpoints, for commands started beside it (`kvmesh admin`).

`kvmesh up` writes `.kvmesh/running.json` ({"pid": ..., "endpoints": {name: address},
"pids": {name: pid}})
once the mesh is healthy and removes it when it stops; a file whose pid is gone (the
launcher was SIGKILLed) is ignored. Paths are relative to the working directory, like
`kvmesh up`'s default `--log-dir .kvmesh/logs`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RUNNING_MESH_FILE = ".kvmesh/running.json"


def write_running(endpoints: dict[str, str], path: str | Path = RUNNING_MESH_FILE,
                  pids: dict[str, int] | None = None) -> Path:
    """`pids`: each service's process id (a restart writes the file again)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "endpoints": endpoints, "pids": pids or {}},
                              indent=2))
    tmp.replace(p)  # readers never see half a file
    return p


def remove_running(path: str | Path = RUNNING_MESH_FILE) -> None:
    Path(path).unlink(missing_ok=True)


def running_endpoints(path: str | Path = RUNNING_MESH_FILE) -> dict[str, str]:
    """{name: address} of the live `kvmesh up` that wrote `path`; {} if none."""
    try:
        data = json.loads(Path(path).read_text())
        os.kill(int(data["pid"]), 0)  # signal 0: is the launcher alive?
        return dict(data["endpoints"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


# -- one `kvmesh up` per log directory ------------------------------------------------------
class AlreadyRunning(RuntimeError):
    pass


def claim(log_dir: str | Path) -> Path:
    """Mark `log_dir` as this process's (`<log_dir>/kvmesh-up.pid`) before anything starts:
    a second `kvmesh up` on the same directory (its SeaweedFS data, its ports) is refused
    by name instead of failing halfway. A mark whose process is gone is taken over.
    AlreadyRunning names the pid that holds it."""
    path = Path(log_dir) / "kvmesh-up.pid"
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                pid = int(path.read_text().strip() or 0)
                os.kill(pid, 0)
            except (OSError, ValueError):
                path.unlink(missing_ok=True)      # its process is gone: take it over
                continue
            raise AlreadyRunning(f"kvmesh up is already running on {log_dir} (pid {pid}); "
                                 "stop it first, or give another --log-dir") from None
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return path
    raise AlreadyRunning(f"{path}: could not be claimed")


def release(path: Path) -> None:
    path.unlink(missing_ok=True)


# -- tokens ------------------------------------------------------------------------------
# The random service/admin tokens of a running `kvmesh up`, so `kvmesh admin` beside it
# works without copying secrets: one file per launcher, readable only by its user
# (directory 0700, file 0600), removed when the mesh stops; found by any endpoint address.
def tokens_dir(env=None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("KVMESH_HOME") or "~/.kvmesh").expanduser() / "tokens"


def write_tokens(endpoints: dict[str, str], tokens: dict[str, str], env=None) -> Path:
    d = tokens_dir(env)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    p = d / f"{os.getpid()}.json"
    fd = os.open(p.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "addresses": sorted(endpoints.values()),
                   "tokens": tokens}, f)
    p.with_suffix(".tmp").replace(p)
    return p


def tokens_for(address: str, env=None) -> dict[str, str]:
    """{env var: token} of the live `kvmesh up` serving `address`; {} if none."""
    d = tokens_dir(env)
    for p in sorted(d.glob("*.json")) if d.is_dir() else ():
        try:
            data = json.loads(p.read_text())
            os.kill(int(data["pid"]), 0)
            if address in data["addresses"]:
                return dict(data["tokens"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return {}
