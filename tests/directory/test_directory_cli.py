"""`kvmesh directory serve` as a real process, and config from the environment."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from kvmesh.directory_client import DirectoryClient
from kvmesh.directory_records import Entry
from kvmesh.launch.backing.proc import free_port, wait_port
from kvmesh.services.directory.config import DirectoryConfig

KEY = "cd" * 32


def test_cli_serves_the_directory_and_stops_on_sigterm(valkey, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.launch.cli", "directory", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--redis-url", valkey.url, "--key-prefix", "t:cli"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_port("127.0.0.1", port, timeout=20, proc=proc)

        async def talk():
            async with DirectoryClient(f"127.0.0.1:{port}") as c:
                await c.heartbeat("cli-e", "127.0.0.1:7001")
                await c.publish("cli-e", [Entry(KEY, 384, 99)])
                return await c.lookup([KEY]), await c.list_engines()

        got, engines = asyncio.run(talk())
        assert [(h.engine_id, h.position) for h in got[KEY]] == [("cli-e", 384)]
        assert [e.engine_id for e in engines] == ["cli-e"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert b"directory listening on 127.0.0.1:" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_config_reads_kvmesh_directory_env_and_checks_invariants():
    env = {"KVMESH_DIRECTORY_LEASE_TTL_S": "4.5", "KVMESH_DIRECTORY_MAX_BATCH": "128",
           "KVMESH_DIRECTORY_REDIS_URL": "redis://r:6380/1", "KVMESH_DIRECTORY_ENTRY_TTL_S": ""}
    cfg = DirectoryConfig.from_env(env, max_batch=None, key_prefix="p")
    assert (cfg.lease_ttl_ms, cfg.max_batch, cfg.redis_url, cfg.key_prefix, cfg.entry_ttl_s) == (
        4500, 128, "redis://r:6380/1", "p", 1800.0)
    with pytest.raises(ValueError, match="KVMESH_DIRECTORY_MAX_BATCH='many'"):
        DirectoryConfig.from_env({"KVMESH_DIRECTORY_MAX_BATCH": "many"})
    for bad in ({"max_batch": 0}, {"lease_ttl_s": 0.1}, {"redis_url": "http://x"},
                {"entry_ttl_s": 10**6}):
        with pytest.raises(ValueError):
            DirectoryConfig(**bad)


@pytest.mark.parametrize("url,shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:s3cr3t@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://kvmesh:s3cr3t@h:6380/1", "rediss://kvmesh:***@h:6380/1"),
    ("redis://kvmesh@h:6379/0", "redis://kvmesh@h:6379/0"),
])
def test_logged_url_never_shows_a_password(url, shown):
    assert DirectoryConfig(redis_url=url).redacted_url == shown


def test_redis_credentials_come_from_the_environment_and_stay_out_of_repr():
    cfg = DirectoryConfig.from_env({"KVMESH_DIRECTORY_REDIS_USERNAME": "kvmesh",
                                    "KVMESH_DIRECTORY_REDIS_PASSWORD": "s3cr3t-pw"})
    assert (cfg.redis_username, cfg.redis_password) == ("kvmesh", "s3cr3t-pw")
    assert "s3cr3t-pw" not in repr(cfg)
