"""`kvmesh` command-line behaviour a new user runs into: prompts from files and stdin,
escapes in --stop, exit 2 with the status for bad input through the gateway, help text
with defaults on every flag, local-only flags grouped and refused without --local.

The gateway cases run the real `kvmesh generate` against a real gateway process whose
only engine address is closed: a request that passes validation ends UNAVAILABLE (exit
1), one that fails it ends with the gateway's own status (exit 2) before any routing.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys

import pytest

from kvmesh.clihelp import walk
from kvmesh.healthcheck import check as health_check
from kvmesh.launch.backing.proc import ManagedProcess, free_port
from kvmesh.launch.cli import build_parser
from kvmesh.launch.generate import read_prompt, unescape
from tests.gateway.conftest import wait_for

KVMESH = [sys.executable, "-m", "kvmesh.launch.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
TWO_MB = 2 << 20


def test_every_flag_has_help_and_shows_its_default():
    missing = []
    for p in walk(build_parser()):
        fmt = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction):
                continue
            text = fmt._get_help_string(a) % {"default": a.default, "prog": p.prog}
            if not a.help or (a.nargs != 0 and "default" not in text.lower()):
                missing.append(f"{p.prog} {a.option_strings[0]}")
    assert not missing, missing


def _sections(help_text: str) -> dict[str, str]:
    out, name = {}, ""
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            name = line[:-1]
        out[name] = out.get(name, "") + line + "\n"
    return out


def test_generate_help_groups_local_only_flags():
    text = subprocess.run([*KVMESH, "generate", "--help"], env=ENV, capture_output=True,
                          text=True, timeout=60).stdout
    sec = _sections(text)
    local = sec["local only (--local): model and cache"]
    where = sec["where it runs (default: through the gateway)"]
    for flag in ("--num-slots", "--model", "--truncation", "--dtype"):
        assert flag in local and flag not in sec["sampling"] and flag not in where
    assert "--stop" in sec["sampling"] and "(default: 64)" in sec["sampling"]
    assert "--stop" not in local and "--gateway" in where and "--local" in where


def test_stop_escapes_are_decoded():
    args = build_parser().parse_args(["generate", "x", "--stop", "\\n", "--stop", "a\\tb",
                                      "--stop", "é€\\u00e9\\\\", "--stop", "plain"])
    assert args.stop == ["\n", "a\tb", "é€é\\", "plain"]
    assert unescape("\\x41\\n") == "A\n"
    with pytest.raises(argparse.ArgumentTypeError, match="bad escape"):
        unescape("ends with a backslash \\")


def test_prompt_from_argument_file_or_stdin(tmp_path):
    p = build_parser()
    f = tmp_path / "prompt.txt"
    f.write_text("from a file ✓\n")
    assert read_prompt(p.parse_args(["generate", "inline"])) == "inline"
    assert read_prompt(p.parse_args(["generate", "--prompt-file", str(f)])) == "from a file ✓\n"
    stdin = io.BytesIO("from stdin ✓".encode())
    assert read_prompt(p.parse_args(["generate", "-"]), stdin) == "from stdin ✓"
    stdin = io.BytesIO(b"dash file")
    assert read_prompt(p.parse_args(["generate", "--prompt-file", "-"]), stdin) == "dash file"
    for argv, msg in ((["generate"], "no prompt"),
                      (["generate", "x", "--prompt-file", str(f)], "not both"),
                      (["generate", "--prompt-file", str(tmp_path / "nope")], "cannot read")):
        with pytest.raises(ValueError, match=msg):
            read_prompt(p.parse_args(argv))
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        read_prompt(p.parse_args(["generate", "--prompt-file", str(f)]))


def test_local_only_flags_without_local_exit_2():
    out = subprocess.run([*KVMESH, "generate", "x", "--num-slots", "4", "--model", "m",
                          "--gateway", "127.0.0.1:1"], env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "--model, --num-slots only apply with --local" in out.stderr


@pytest.fixture(scope="module")
def lone_gateway(tmp_path_factory):
    """A real gateway whose one engine address has nothing listening."""
    port = free_port()
    logs = tmp_path_factory.mktemp("cli_gateway")
    proc = ManagedProcess("gateway", [*KVMESH, "gateway", "serve", "--port", str(port),
                                      "--engines", f"127.0.0.1:{free_port()}"], logs,
                          env={"OMP_NUM_THREADS": "1"}).start()
    try:
        assert wait_for(lambda: health_check(f"127.0.0.1:{port}", timeout=0.5), timeout=60), \
            proc.tail()
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop()


def _generate(addr: str, *argv: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*KVMESH, "generate", *argv, "--gateway", addr], input=stdin,
                          env=ENV, capture_output=True, timeout=60)


def test_two_mb_prompt_from_stdin_or_file_reaches_the_gateway(lone_gateway, tmp_path):
    # 2 MB on the command line fails in exec ("Argument list too long"); via stdin or a
    # file it reaches the gateway, which refuses it for size: exit 2 with the status.
    big = b"a" * TWO_MB
    out = _generate(lone_gateway, "-", stdin=big)
    err = out.stderr.decode()
    assert out.returncode == 2, err
    assert f"RESOURCE_EXHAUSTED: prompt is {TWO_MB} bytes; the limit is 1048576" in err
    f = tmp_path / "big.txt"
    f.write_bytes(big)
    out = _generate(lone_gateway, "--prompt-file", str(f))
    assert out.returncode == 2 and b"RESOURCE_EXHAUSTED" in out.stderr


def test_bad_input_via_gateway_exits_2_with_status(lone_gateway):
    out = _generate(lone_gateway, "hello", "--top-p", "1.5")
    assert out.returncode == 2
    assert b"INVALID_ARGUMENT: sampling.top_p must be in (0, 1], got 1.5" in out.stderr
    # valid input that no engine can serve is not the user's fault: exit 1
    out = _generate(lone_gateway, "hello", "--max-tokens", "2")
    assert out.returncode == 1 and b"UNAVAILABLE" in out.stderr


def test_admin_finds_the_running_mesh(tmp_path, monkeypatch):
    from kvmesh.running import RUNNING_MESH_FILE, remove_running, write_running
    from kvmesh.services.kvstore.cli import DEFAULT_ADDR, admin_address

    monkeypatch.chdir(tmp_path)
    assert admin_address(None, {}) == DEFAULT_ADDR  # nothing running here
    path = write_running({"kvstore": "127.0.0.1:45678"})
    assert path.resolve() == tmp_path / RUNNING_MESH_FILE
    assert admin_address(None, {}) == "127.0.0.1:45678"
    assert admin_address(None, {"KVMESH_KVSTORE_ADDR": "10.0.0.1:7100"}) == "10.0.0.1:7100"
    assert admin_address("h:1", {"KVMESH_KVSTORE_ADDR": "10.0.0.1:7100"}) == "h:1"
    # a launcher that died without cleaning up: its file is ignored
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"pid": dead.pid, "endpoints": {"kvstore": "127.0.0.1:1"}}))
    assert admin_address(None, {}) == DEFAULT_ADDR
    remove_running()
    assert not path.exists() and admin_address(None, {}) == DEFAULT_ADDR


def test_gateway_exits_2_when_its_http_port_is_taken():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([*KVMESH, "gateway", "serve", "--port", "0", "--engines",
                              f"127.0.0.1:{free_port()}", "--http-port", str(port)],
                             env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"kvmesh gateway: HTTP API: cannot listen on 127.0.0.1:{port}" in out.stderr
