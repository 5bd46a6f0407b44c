"""`kvmesh engine serve --tensor-parallel 2` over real gRPC (services/engine/split.py): the
engine of two gloo ranks answers Generate with the tokens one process's engine gives, a
prefix hit included (a bounded replay under --swa-policy zero: cached and replayed tokens in
its usage); a rank SIGKILLed mid-stream ends the stream UNAVAILABLE within a bound and
takes every process of the engine down with it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.engine.core.sampling import SamplingParams
from services.engine.rpc.client import EngineClient
from tests.engine.deepseek_v4.test_engine import checkpoint, engine, random_prompt

ROOT = Path(__file__).resolve().parents[3]
FLAGS = ("--dtype", "float64", "--swa-policy", "zero", "--num-blocks", "32")
BOUND_S = 20.0          # a dead rank's stream ends, and the engine is gone, within this


def ranks_of(pid: int) -> list[int]:
    """The rank processes the engine's process started, in start order (not
    multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split()
                  if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").exists() and "zombie" not in \
        Path(f"/proc/{pid}/status").read_text().lower()


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4")
    checkpoint("mixed", d)
    return d


@pytest.fixture
def split_engine(directory):
    from launch.backing.proc import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "engine", "serve", "--model",
                             str(directory), "--port", str(port), "--tensor-parallel", "2",
                             "--threads", "2", *FLAGS], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    address = f"127.0.0.1:{port}"

    async def ready():
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return await EngineClient(address).model_info()
            except grpc.aio.AioRpcError:
                assert time.monotonic() < deadline, "the split engine did not come up"
                await asyncio.sleep(0.5)
    asyncio.run(ready())
    yield proc, address
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_split_engine_serves_what_one_process_serves(directory, split_engine):
    proc, address = split_engine
    first, other = random_prompt(300, 1), random_prompt(120, 2)
    prompts = [first, other, first + random_prompt(40, 3)]
    alone = engine(directory, *FLAGS)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = []
    for p in prompts:                        # one after another, as the calls below
        req = alone.add_request(p, params)
        while alone.has_work:
            alone.step()
        want.append((req.output, req.cached_tokens, req.replayed_tokens))

    async def calls():
        client = EngineClient(address)
        out = []
        for p in prompts:
            ids, _, last = await client.complete(p, max_tokens=8, temperature=0.0, ignore_eos=True)
            out.append((ids, last.usage.cached_tokens, last.usage.replayed_tokens))
        return out
    got = asyncio.run(calls())
    assert got == want
    assert got[2][1] == 256 and got[2][2] > 0     # the third prompt: blocks hit, replayed
    proc.send_signal(signal.SIGTERM)              # stops as a single engine does
    assert proc.wait(timeout=60) == 0


def test_a_rank_killed_mid_stream_takes_the_engine_down_within_the_bound(split_engine):
    proc, address = split_engine
    ranks = ranks_of(proc.pid)
    assert len(ranks) == 2                        # started in rank order: rank 1 is the later

    async def stream():
        client = EngineClient(address)
        got = 0
        async for msg in client.generate(random_prompt(50, 4), max_tokens=4000,
                                         temperature=0.0, ignore_eos=True):
            got += len(msg.token_ids)
            if got >= 2 and alive(ranks[1]):
                os.kill(ranks[1], signal.SIGKILL)
                killed[0] = time.monotonic()
        return got

    killed = [0.0]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(asyncio.wait_for(stream(), timeout=120))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - killed[0] < BOUND_S
    assert proc.wait(timeout=BOUND_S) != 0
    assert time.monotonic() - killed[0] < 2 * BOUND_S
    assert not any(alive(pid) for pid in ranks)


@pytest.mark.parametrize("flags,message", [
    ((), "DeepSeek V4 checkpoints only so far"),                       # the V4.1 default
    (("--model", "MODEL", "--step-slo-ms", "70"), "needs --step-slo-ms 0"),
    (("--model", "MODEL", "--speculative", "ngram:3"), "needs --spec-policy always"),
    (("--model", "MODEL", "--expert-parallel", "3"), "n_routed_experts (4) is not divisible by 3"),
])
def test_a_split_engine_it_cannot_run_is_refused_before_any_rank_starts(directory, flags,
                                                                        message):
    argv = [str(directory) if f == "MODEL" else f for f in flags]
    run = subprocess.run([sys.executable, "-m", "launch.cli", "engine", "serve",
                          "--tensor-parallel", "2", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
