"""`kvmesh engine serve --model DIR` as a process, called over gRPC: two concurrent
generations give transformers' greedy tokens, GetModelInfo names the checkpoint, bad input is
INVALID_ARGUMENT naming the field, and flags the V4 path does not serve exit 2 by name."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest

from kvmesh.healthcheck import wait_healthy
from kvmesh.launch.backing.proc import ManagedProcess, free_port
from kvmesh.services.engine.rpc.client import EngineClient
from tests.engine.deepseek_v4 import tiny
from tests.engine.deepseek_v4.test_engine import checkpoint, hf_greedy, random_prompt

pytest.importorskip("transformers")
KVMESH = [sys.executable, "-m", "kvmesh.launch.cli"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixed-v4")
    hf = checkpoint("mixed", directory)
    port = free_port()
    proc = ManagedProcess("engine", [*KVMESH, "engine", "serve", "--model", str(directory),
                                     "--dtype", "float64", "--port", str(port)],
                          tmp_path_factory.mktemp("logs"), env={"OMP_NUM_THREADS": "1"}).start()
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout=120, proc=proc)
        yield f"127.0.0.1:{port}", directory, hf
    finally:
        proc.stop()


def test_concurrent_generations_over_grpc_give_transformers_tokens(served):
    address, directory, hf = served
    prompts = [tiny.prompt("mixed").tolist(), random_prompt(33, seed=21)]

    async def both():
        client = EngineClient(address)
        try:
            return await asyncio.gather(*(client.complete(p, max_tokens=20, temperature=0.0,
                                                          ignore_eos=True) for p in prompts))
        finally:
            await client.close()
    results = asyncio.run(both())
    for (ids, _, last), prompt in zip(results, prompts, strict=True):
        assert ids == hf_greedy(hf, prompt, 20)
        assert (last.usage.prompt_tokens, last.usage.generated_tokens) == (len(prompt), 20)


def test_model_info_and_bad_input(served):
    address, directory, _ = served

    async def ask():
        client = EngineClient(address)
        try:
            info = await client.model_info()
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await client.complete([5, 100], max_tokens=2)
            return info, bad.value
        finally:
            await client.close()
    info, err = asyncio.run(ask())
    cfg = json.loads(info.model_config_json)
    assert (info.preset, cfg["name"], cfg["block_size"], cfg["window"], cfg["vocab_size"]) \
        == (directory.name, directory.name, 128, 8, 100)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids [100]" in err.details()


def test_unserved_flags_exit_2_by_name(served):
    _, directory, _ = served
    out = subprocess.run([*KVMESH, "engine", "serve", "--model", str(directory),
                          "--truncation", "mask", "--keep-tokens", "200"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--truncation: not served for DeepSeek V4 checkpoints yet" in out.stderr
