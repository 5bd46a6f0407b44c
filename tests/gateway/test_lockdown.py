"""`kvmesh up`'s lockdown, with real processes: no port beyond loopback, Valkey and S3
refuse callers without the run's credentials, no credential in logs or command lines,
and a public bind without API keys is refused.

The mesh is `Mesh` with what `kvmesh up` passes (random tokens, `lock_backing`).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvmesh.auth import check_public_bind, is_loopback
from kvmesh.errors import InvalidArgument
from kvmesh.s3 import S3Keys, s3_client

MESH_OVERRIDES = dict(lock_backing=True, service_token=secrets.token_urlsafe(32),
                      admin_token=secrets.token_urlsafe(32))
KVMESH = [sys.executable, "-m", "kvmesh.launch.cli"]


# -- no port beyond loopback ---------------------------------------------------------
def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _listening() -> list[tuple[str, int, str]]:
    """(local address, port, inode) of every TCP socket in LISTEN state (0A)."""
    rows = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            local, state, inode = f[1], f[3], f[9]
            if state != "0A":
                continue
            addr_hex, port_hex = local.split(":")
            raw = bytes.fromhex(addr_hex)
            # /proc prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, words)
            rows.append((addr, int(port_hex, 16), inode))
    return rows


def mesh_pids(mesh) -> list[int]:
    pids = mesh.pids()
    pids += [s.proc.proc.pid for s in mesh.seaweed.servers if s.proc is not None]
    return pids


def test_no_port_of_the_mesh_listens_beyond_loopback(mesh):
    inodes = set().union(*(_socket_inodes(p) for p in mesh_pids(mesh)))
    ours = [(addr, port) for addr, port, inode in _listening() if inode in inodes]
    # every endpoint kvmesh up prints is among the sockets checked (the check is not empty)
    ports = {port for _, port in ours}
    for name, where in mesh.endpoints.items():
        port = int(where.rsplit(":", 1)[1].split("/")[0])
        assert port in ports, (name, where, sorted(ports))
    public = [(a, p) for a, p in ours if not is_loopback(a)]
    assert not public, f"listening beyond loopback: {public}"
    assert len(ours) >= len(mesh.endpoints)


# -- Valkey ----------------------------------------------------------------------------
def _redis(mesh, *commands: bytes) -> bytes:
    host, port = mesh.valkey.host, mesh.valkey.port
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"".join(commands))
        s.settimeout(1.0)
        got = b""
        try:
            while got.count(b"\r\n") < len(commands):
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            pass
        return got


def _cmd(*args: str) -> bytes:
    from kvmesh.launch.backing.valkey import _resp

    return _resp(*args)


def test_valkey_refuses_commands_without_the_password(mesh):
    assert _redis(mesh, _cmd("PING")).startswith(b"-NOAUTH")
    assert _redis(mesh, _cmd("GET", "kvmesh:x")).startswith(b"-NOAUTH")
    wrong = _redis(mesh, _cmd("AUTH", mesh.redis_user, "not-the-password"), _cmd("PING"))
    assert wrong.startswith(b"-WRONGPASS") and b"NOAUTH" in wrong
    assert _redis(mesh, _cmd("AUTH", "default", "")).startswith(b"-")  # default user is off
    ok = _redis(mesh, _cmd("AUTH", mesh.redis_user, mesh.redis_password), _cmd("PING"))
    assert ok == b"+OK\r\n+PONG\r\n"
    # least privilege: the directory's user cannot reconfigure or wipe the server
    for cmd in (_cmd("CONFIG", "SET", "requirepass", ""), _cmd("FLUSHALL"),
                _cmd("SET", "elsewhere", "1")):
        got = _redis(mesh, _cmd("AUTH", mesh.redis_user, mesh.redis_password), cmd)
        assert got.startswith(b"+OK\r\n-NOPERM"), got


def test_directory_works_with_the_password(mesh, gw):
    from kvmesh.healthcheck import check

    assert check(mesh.endpoints["directory"])  # SERVING only while its Redis answers
    resp = gw.generate("x" * 300, max_tokens=2, temperature=0.0)
    assert resp.usage.generated_tokens == 2


# -- S3 ------------------------------------------------------------------------------
def _http(method: str, url: str) -> int:
    req = urllib.request.Request(url, method=method, data=b"x" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_s3_refuses_unsigned_and_wrongly_signed_requests(mesh):
    endpoint = mesh.seaweed.servers[0].endpoint
    bucket = mesh.seaweed.layout[0][1]
    assert _http("GET", f"{endpoint}/") == 403                      # list buckets
    assert _http("GET", f"{endpoint}/{bucket}") == 403              # list objects
    assert _http("PUT", f"{endpoint}/{bucket}/intruder") == 403
    assert _http("GET", f"{endpoint}/{bucket}/intruder") == 403
    assert _http("DELETE", f"{endpoint}/{bucket}/anything") == 403
    wrong = s3_client(endpoint, keys=S3Keys("kvmesh-wrong", "not-the-secret"))
    with pytest.raises(Exception, match="(?i)AccessDenied|InvalidAccessKeyId|Forbidden|403"):
        wrong.list_objects_v2(Bucket=bucket)
    right = s3_client(endpoint, keys=mesh.s3_keys)
    right.list_objects_v2(Bucket=bucket)  # the kvstore's keys work


def test_filer_volume_and_master_refuse_requests_without_weeds_jwt(mesh, gw):
    """S3 is not the only door: weed's filer would serve the buckets' files over plain HTTP,
    its master sign write JWTs for any caller, and its volume server serves the chunks. weed
    runs with -disableHttp, so the filer and the master serve no HTTP (404), and the volume
    server wants a JWT signed with the run's key (security.toml), which only weed's S3
    gateway makes: unsigned -> 401."""
    prompt = " ".join(f"w{i}" for i in range(400))              # > 1 block of tokens
    gw.generate(prompt, max_tokens=2, temperature=0.0)        # its block's shards go to S3
    server = mesh.seaweed.servers[0]
    bucket = mesh.seaweed.layout[0][1]
    right = s3_client(server.endpoint, keys=mesh.s3_keys)
    deadline = time.monotonic() + 20                          # the kvstore puts in the background
    while not (keys := [o["Key"] for o in right.list_objects_v2(Bucket=bucket)
                        .get("Contents", [])]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert keys, "no shard written to the first location"
    filer = f"http://127.0.0.1:{server.ports['filer']}"
    assert _http("GET", f"{filer}/buckets/{bucket}/{keys[0]}") == 404     # a shard
    assert _http("GET", f"{filer}/buckets/") == 404                       # listing
    assert _http("PUT", f"{filer}/buckets/{bucket}/intruder") == 404
    assert _http("DELETE", f"{filer}/buckets/{bucket}/{keys[0]}") == 404
    assert right.get_object(Bucket=bucket, Key=keys[0])["Body"].read()   # still there
    master = f"http://127.0.0.1:{server.ports['master']}"
    # no HTTP API (only /cluster/status, which names the raft leader, stays)
    for path in ("/dir/status", "/dir/assign", "/dir/lookup?volumeId=1", "/vol/status"):
        assert _http("GET", f"{master}{path}") == 404, path
    volume = f"http://127.0.0.1:{server.ports['volume']}"
    for fid in ("1,0123456789", "3,01637037d6"):                          # ids of live volumes
        assert _http("PUT", f"{volume}/{fid}") == 401
        assert _http("GET", f"{volume}/{fid}") == 401


# -- credentials never in logs or on command lines -------------------------------------
def test_credentials_never_appear_in_logs_or_command_lines(mesh, gw):
    gw.generate("y" * 400, max_tokens=2, temperature=0.0)  # puts blocks: S3 and kvstore busy
    secret_values = [mesh.redis_password, mesh.s3_keys.secret_key, mesh.cfg.service_token,
                     mesh.cfg.admin_token]
    logs = [p for p in Path(mesh.cfg.log_dir).rglob("*") if p.is_file()
            and (p.suffix == ".log" or "logs" in p.parts[-2:] or ".log." in p.name)]
    assert len(logs) >= 6, logs
    for path in logs:
        text = path.read_bytes()
        for value in secret_values:
            assert value.encode() not in text, f"a credential in {path}"
    for pid in mesh_pids(mesh):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        for value in secret_values:
            assert value.encode() not in cmdline, f"a credential on the command line of {pid}"


# -- public bind -----------------------------------------------------------------------
@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.0.0.2", True),
                                       ("::1", True), ("[::1]", True),
                                       ("::ffff:127.0.0.1", True), ("::ffff:10.0.0.5", False), ("localhost", True),
                                       ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
                                       ("example.com", False)])
def test_loopback_addresses(host, loop):
    assert is_loopback(host) is loop


def test_public_bind_rule():
    check_public_bind("127.0.0.1", has_api_keys=False, allowed=False)
    check_public_bind("0.0.0.0", has_api_keys=True, allowed=False)
    check_public_bind("0.0.0.0", has_api_keys=False, allowed=True)
    with pytest.raises(InvalidArgument, match="--allow-unauthenticated"):
        check_public_bind("0.0.0.0", has_api_keys=False, allowed=False)


@pytest.mark.parametrize("argv", [
    ["up", "--host", "0.0.0.0", "--demo"],
    ["gateway", "serve", "--host", "0.0.0.0", "--port", "0", "--engines", "127.0.0.1:9"],
])
def test_public_bind_without_keys_is_refused_before_starting(argv, tmp_path):
    out = subprocess.run([*KVMESH, *argv], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--allow-unauthenticated" in out.stderr and "--api-keys" in out.stderr
    assert not (tmp_path / ".kvmesh").exists()  # nothing was started
