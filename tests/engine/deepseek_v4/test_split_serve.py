"""`kvmesh engine serve --tensor-parallel 2` over real gRPC (services/engine/split.py): the
engine of two gloo ranks answers Generate with the tokens one process's engine gives, a
prefix hit included (a bounded replay under --swa-policy zero: cached and replayed tokens in
its usage), on a DeepSeek V4 checkpoint and on the shipped V4.1 default; a rank SIGKILLed mid-stream ends the stream UNAVAILABLE within a bound and
takes every process of the engine down with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.rpc.client import EngineClient
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


@contextlib.contextmanager
def started(*argv: str):
    """`kvmesh engine serve --tensor-parallel 2 ARGV` on a free port, ready: (process,
    address); stopped with SIGTERM after."""
    from kvmesh.launch.backing.proc import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.launch.cli", "engine", "serve", "--port",
                             str(port), "--tensor-parallel", "2", "--threads", "2", *argv],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    try:
        asyncio.run(ready())
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


@pytest.fixture
def split_engine(directory):
    with started("--model", str(directory), *FLAGS) as running:
        yield running


def greedy(address: str, prompts: list[list[int]], n: int = 8) -> list[tuple]:
    """Each prompt's greedy tokens, cached and replayed tokens, one call after another."""
    async def calls():
        client = EngineClient(address)
        out = []
        for p in prompts:
            ids, _, last = await client.complete(p, max_tokens=n, temperature=0.0, ignore_eos=True)
            out.append((ids, last.usage.cached_tokens, last.usage.replayed_tokens))
        return out
    return asyncio.run(calls())


def alone(core, prompts: list[list[int]], n: int = 8) -> list[tuple]:
    """greedy() through one process's engine."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = []
    for p in prompts:
        req = core.add_request(p, params)
        while core.has_work:
            core.step()
        out.append((req.output, req.cached_tokens, req.replayed_tokens))
    return out


def test_a_split_engine_serves_what_one_process_serves(directory, split_engine):
    proc, address = split_engine
    first = random_prompt(300, 1)
    prompts = [first, random_prompt(120, 2), first + random_prompt(40, 3)]
    got = greedy(address, prompts)
    assert got == alone(engine(directory, *FLAGS), prompts)
    assert got[2][1] == 256 and got[2][2] > 0     # the third prompt: blocks hit, replayed
    proc.send_signal(signal.SIGTERM)              # stops as a single engine does
    assert proc.wait(timeout=60) == 0


def test_the_shipped_default_model_splits_too():
    """DeepSeek V4.1 (the shipped deepseek-v41-tiny, truncation compact) split 2 ways."""
    from tests.engine.engines import serve_core

    g = torch.Generator().manual_seed(5)
    first = torch.randint(3, 4096, (400,), generator=g).tolist()
    prompts = [first, first + torch.randint(3, 4096, (60,), generator=g).tolist()]
    want = alone(serve_core("--dtype", "float64"), prompts, 6)
    with started("--dtype", "float64") as (_, address):
        assert greedy(address, prompts, 6) == want
    assert want[1][1] > 0                         # the second prompt hit the first's blocks


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
    (("--model", "MODEL", "--expert-parallel", "3"), "n_routed_experts (4) is not divisible by 3"),
])
def test_a_split_engine_it_cannot_run_is_refused_before_any_rank_starts(directory, flags,
                                                                        message, capsys):
    from kvmesh.launch.cli import main

    argv = [str(directory) if f == "MODEL" else f for f in flags]
    assert main(["engine", "serve", "--tensor-parallel", "2", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_checkpoint_fails_the_split_engine_naming_the_file(tmp_path, capsys):
    """A shard the index lists but the directory lacks: refused before any rank starts. A
    tensor of the wrong shape inside a shard: the ranks fail at load, and the command says
    which tensor (no traceback) and exits 1."""
    from safetensors.torch import load_file, save_file

    from kvmesh.launch.cli import main
    from tests.engine.deepseek_v4 import tiny

    model = tiny.hf_model("mixed")
    missing, wrong = tmp_path / "missing", tmp_path / "wrong"
    for d in (missing, wrong):
        tiny.resave(model, d, "transformers", shards=2)
    shard = sorted(missing.glob("model-*.safetensors"))[0]
    shard.unlink()
    assert main(["engine", "serve", "--tensor-parallel", "2", "--model", str(missing)]) == 2
    assert shard.name in capsys.readouterr().err
    first = sorted(wrong.glob("model-*.safetensors"))[0]
    tensors = load_file(first)
    name = next(n for n in tensors if n.endswith("q_a_proj.weight"))
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, first, metadata={"format": "pt"})
    assert main(["engine", "serve", "--tensor-parallel", "2", "--model", str(wrong)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvmesh engine: ") and name in err and "CheckpointError" not in err
