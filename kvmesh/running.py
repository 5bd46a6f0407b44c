"""The running `kvmesh up`'s endpoints, for commands started beside it (`kvmesh admin`).

`kvmesh up` writes `.kvmesh/running.json` ({"pid": ..., "endpoints": {name: address}})
once the mesh is healthy and removes it when it stops; a file whose pid is gone (the
launcher was SIGKILLed) is ignored. Paths are relative to the working directory, like
`kvmesh up`'s default `--log-dir .kvmesh/logs`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RUNNING_MESH_FILE = ".kvmesh/running.json"


def write_running(endpoints: dict[str, str], path: str | Path = RUNNING_MESH_FILE) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "endpoints": endpoints}, indent=2))
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
