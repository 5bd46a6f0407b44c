"""`kvmesh up` as a user runs it: --demo exits 0, SIGTERM stops everything, no port left open."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from tokenizers import Tokenizer

from kvmesh.launch.backing.proc import port_open
from kvmesh.launch.up import DEMO_FOLLOW_UP, DEMO_PROMPT
from kvmesh.shipped import DEFAULT_MODEL

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
UP = [sys.executable, "-m", "kvmesh.launch.cli", "up", "--gateway-port", "0", "--http-port", "0",
      "--metrics-port", "0",
      "--num-slots", "4", "--num-blocks", "64"]


def ports_in(text: str) -> set[int]:
    return {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)}


def test_up_demo_streams_prints_usage_and_exits_zero(tmp_path):
    # two kvstore replicas on the shared index in the mesh's Valkey, engines over both
    out = subprocess.run([*UP, "--demo", "--num-kvstores", "2", "--log-dir", str(tmp_path / "logs")],
                         env=ENV,
                         capture_output=True, text=True, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "kvmesh is up" in text
    usages = re.findall(r"usage: prompt=(\d+) cached=(\d+) replayed=(\d+) generated=(\d+)", text)
    assert len(usages) == 2, text[-3000:]
    # the second demo request extends the first: its first full blocks come from the cache
    # (fresh log dir: nothing in the kvstore before)
    # (the shipped default model's tokenizer counts the tokens)
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    t1, t2 = (len(tok.encode(text, add_special_tokens=False).ids)
              for text in (DEMO_PROMPT, DEMO_PROMPT + DEMO_FOLLOW_UP))
    assert usages[0] == (str(t1), "0", "0", "32")
    # under truncation compact (kvmesh up's default on V4.1) a hit reuses at most
    # L - KEEP (134) tokens, in whole blocks, and resumes exactly from a snapshot (or from
    # position 0), so nothing is replayed
    cached = min(t1 // 128, (t2 - 134) // 128) * 128
    assert cached and usages[1] == (str(t2), str(cached), "0", "32")
    n1, n2 = (len(text.encode()) for text in (DEMO_PROMPT, DEMO_PROMPT + DEMO_FOLLOW_UP))
    # what `kvmesh up --help` promises for --demo is what it did (test_demo_help_...)
    heads = re.findall(r"demo \d/3: GenerateStream via \S+ \(temperature ([\d.]+), seed (\d+), "
                       r"(\d+) tokens, (\d+)-byte prompt\)", text)
    assert heads == [("0.8", "1", "32", str(n1)), ("0.8", "1", "32", str(n2))], text[-3000:]
    # the third: a chat request through the HTTP API, answered
    assert "demo 3/3: POST http://127.0.0.1:" in text and "/v1/chat/completions" in text
    assert re.search(r"usage: prompt=\d+ completion=[1-9]\d* finish=(stop|length)", text), text[-3000:]
    for name in ("kvstore", "kvstore-b", "directory", "engine-a", "engine-b", "gateway"):
        assert (tmp_path / "logs" / f"{name}.log").exists()
    assert list((tmp_path / "logs" / "valkey").glob("appendonly*")), "index not persisted"
    ports = ports_in(text)
    assert len(ports) >= 5
    assert not [p for p in ports if port_open("127.0.0.1", p)], "a service outlived kvmesh up"


def test_demo_help_says_what_the_demo_does():
    from kvmesh.launch.up import DEMO_SEED, DEMO_TEMPERATURE, DEMO_TOKENS

    out = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "up", "--help"], env=ENV,
                         capture_output=True, text=True, timeout=60)
    text = " ".join(out.stdout.split())
    assert (DEMO_TEMPERATURE, DEMO_SEED, DEMO_TOKENS) == (0.8, 1, 32)  # checked by the run above
    assert (f"{DEMO_TOKENS} tokens each, sampled at temperature {DEMO_TEMPERATURE} with seed "
            f"{DEMO_SEED}") in text
    assert "greedy" not in text
    assert f"a {len(DEMO_PROMPT.encode())}-byte Python snippet" in text
    assert "exit 0" in text and "extends the first" in text
    assert "/v1/chat/completions" in text


def check_printed_addresses(text: str) -> None:
    """The HTTP API and kvstore admin addresses `kvmesh up` prints are the live ones."""
    url = re.search(r"OpenAI-compatible HTTP API: (http://127\.0\.0\.1:\d+)/v1", text).group(1)
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        assert json.load(resp)["data"][0]["id"] == DEFAULT_MODEL.name
    kv = re.search(r"kvstore admin: (127\.0\.0\.1:\d+) +kvmesh admin --kvstore \1 gc stats",
                   text).group(1)
    out = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "admin", "--kvstore", kv, "gc",
                          "stats"], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def test_up_stops_everything_on_sigterm(tmp_path):
    log = tmp_path / "up.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([*UP, "--restart", "--log-dir", str(tmp_path / "logs")],
                                env=ENV, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops the mesh" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ports = ports_in(log.read_text())
        assert all(port_open("127.0.0.1", p) for p in ports)
        check_printed_addresses(log.read_text())
        running = json.loads((tmp_path / "running.json").read_text())  # beside --log-dir
        assert running["pid"] == proc.pid and running["endpoints"]["kvstore"] in log.read_text()
        # supervision: an engine SIGKILLed is reported at once and (--restart) started again
        os.kill(running["pids"]["engine-a"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while "engine-a is back" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        text = log.read_text()
        assert "engine-a exited with status -9" in text and "restarting engine-a" in text
        again = json.loads((tmp_path / "running.json").read_text())["pids"]["engine-a"]
        assert again != running["pids"]["engine-a"] and os.kill(again, 0) is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "kvmesh stopped" in log.read_text()
    assert not (tmp_path / "running.json").exists()
    assert not [p for p in ports if port_open("127.0.0.1", p)], "a service outlived kvmesh up"
