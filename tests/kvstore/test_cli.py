"""The real `kvmesh kvstore serve` process and the admin commands against it."""

import json
import os
import subprocess
import sys

from kvmesh.launch.backing.proc import ManagedProcess, free_port, wait_port
from tests.kvstore.conftest import call, hexkey


def kvmesh(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_serve_then_admin_commands(locations, tmp_path):
    port = free_port()
    env = {"KVMESH_KVSTORE_LOCATIONS": ",".join(str(x) for x in locations),
           "KVMESH_KVSTORE_ADDR": f"127.0.0.1:{port}"}
    proc = ManagedProcess(
        "kvstore", [sys.executable, "-m", "kvmesh.launch.cli", "kvstore", "serve", "--port", str(port),
                    "--data-dir", str(tmp_path / "kv"), "--capacity-bytes", "1000000"],
        tmp_path, env=env,
    ).start()
    try:
        wait_port("127.0.0.1", port, timeout=30, proc=proc.proc)
        items = [(hexkey(i), bytes([i]) * (1000 * i)) for i in range(1, 4)]
        call(f"127.0.0.1:{port}", lambda c: c.put(items, traffic_class="agent"))
        ls = kvmesh("admin", "ls", env=env)
        assert ls.returncode == 0, ls.stderr
        assert all(k in ls.stdout for k, _ in items) and "3 of 3 objects" in ls.stdout
        stats = kvmesh("admin", "gc", "stats", env=env)
        assert stats.returncode == 0 and "shard locations up: 12/12" in stats.stdout
        assert "6,000" in stats.stdout  # 1000 + 2000 + 3000 bytes
        dry = kvmesh("admin", "gc", "run", "--dry-run", env=env)
        assert dry.returncode == 0 and "would remove 0 of 6,000 bytes" in dry.stdout
        as_json = {cmd: json.loads(kvmesh("admin", "--json", *cmd.split(), env=env).stdout)
                   for cmd in ("ls", "gc stats", "gc run --dry-run", "scrub")}
        assert sorted(o["key"] for o in as_json["ls"]) == sorted(k for k, _ in items)
        assert int(as_json["gc stats"]["bytes"]) == 6000
        assert as_json["gc run --dry-run"]["dry_run"] is True
        scrub = as_json["scrub"]            # int64 fields are JSON strings (proto3 JSON)
        assert int(scrub["healthy"]) == int(scrub["objects"]) >= 1 and scrub["lost"] == []
        # unreachable: 1 (a failure), as `kvmesh generate`; 2 is for usage errors
        bad = kvmesh("admin", "--kvstore", "127.0.0.1:1", "--timeout", "2", "gc", "stats")
        assert bad.returncode == 1 and "UNAVAILABLE" in bad.stderr
        usage = kvmesh("admin")
        assert usage.returncode == 2 and "admin_command" not in usage.stderr
        assert "{gc,ls,scrub,reindex}" in usage.stderr
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.tail()
    assert "kvstore serving" in proc.tail()
