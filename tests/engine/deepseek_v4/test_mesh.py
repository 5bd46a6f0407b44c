"""A mesh of two DeepSeek V4 engines (`kvmesh up --model DIR`'s processes: real SeaweedFS,
Valkey, kvstore, directory and gateway): a prompt's blocks written through to the kvstore
and its snapshot published by one engine make the other engine's hit, equal to transformers'
greedy tokens; the gateway's OpenAI API names the checkpoint and continues a prompt as
transformers does."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.launch.mesh import Mesh, MeshConfig
from kvmesh.services.engine.rpc.client import EngineClient
from tests.engine.deepseek_v4.test_engine import checkpoint, hf_greedy, random_prompt

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-v4")
    hf = checkpoint("flash_geometry", directory)
    cfg = MeshConfig(log_dir=tmp_path_factory.mktemp("v4mesh") / "logs", engines=2,
                     num_slots=4, num_blocks=64, model=str(directory),
                     engine_extra=("--dtype", "float64", "--fetch-deadline-ms", "5000",
                                   "--swa-fetch", "always"))
    m = Mesh(cfg).start()
    try:
        yield m, directory, hf
    finally:
        m.stop()


def _engine_call(address: str, fn):
    async def go():
        client = EngineClient(address)
        try:
            return await fn(client)
        finally:
            await client.close()
    return asyncio.run(go())


def _stats(address: str) -> dict:
    return _engine_call(address, lambda c: c.stats())


def _written_and_published(address: str, timeout_s: float = 30.0) -> None:
    """Wait until the engine has written 2 blocks through to the kvstore and published a
    snapshot to the directory (both run beside the engine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = _stats(address)
        if s.get("kvstore_blocks_written", 0) >= 2 and s.get("directory_published", 0) >= 1:
            return
        time.sleep(0.2)
    raise AssertionError(f"engine {address} did not write its blocks and publish: {_stats(address)}")


def _served_after_the_other(m: Mesh, first: list[int], second: list[int], n: int):
    """`first` on one engine until its blocks are written and its snapshot published, then
    `second` greedily for n tokens on the other -> (its ids, last message, its address)."""
    a, b = (m.endpoints[name] for name in m.engine_names)
    _engine_call(a, lambda c: c.complete(first, max_tokens=2, temperature=0.0, ignore_eos=True))
    _written_and_published(a)
    ids, _, last = _engine_call(b, lambda c: c.complete(second, max_tokens=n, temperature=0.0,
                                                        ignore_eos=True))
    return ids, last, b


def test_one_engines_blocks_and_snapshot_make_the_others_hit(mesh):
    m, _, hf = mesh
    first = random_prompt(300, seed=31)
    second = first[:256] + random_prompt(40, seed=32)
    ids, last, b = _served_after_the_other(m, first, second, 16)
    assert ids == hf_greedy(hf, second, 16)
    a = m.endpoints[m.engine_names[0]]
    s = _stats(b)
    assert (s["block_hits_remote"], s["snapshot_hits"], s["peer_snapshot_fetches"]) == (2, 1, 1), \
        ({k: v for k, v in s.items() if v}, {k: v for k, v in _stats(a).items() if v})
    assert last.usage.cached_tokens == 256


def test_openai_client_through_the_gateway(mesh):
    import openai
    from tokenizers import Tokenizer

    m, directory, hf = mesh
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    client = openai.OpenAI(base_url=m.endpoints["gateway-http"] + "/v1", api_key="unused")
    assert [model.id for model in client.models.list().data] == [directory.name]
    prompt = random_prompt(50, seed=33)
    expected = hf_greedy(hf, prompt, 12)
    if hf.config.eos_token_id in expected:
        expected = expected[:expected.index(hf.config.eos_token_id)]
    out = client.completions.create(model=directory.name, prompt=tok.decode(prompt),
                                    max_tokens=12, temperature=0)
    assert out.choices[0].text.strip() == tok.decode(expected)


@pytest.fixture(scope="module")
def pd_mesh(tmp_path_factory):
    """`kvmesh up --pd --model DIR`: engine-a prefills (396-row rings), two engines decode."""
    directory = tmp_path_factory.mktemp("tiny-v4-pd")
    hf = checkpoint("mixed", directory)
    cfg = MeshConfig(log_dir=tmp_path_factory.mktemp("v4pd") / "logs", engines=3, pd=True,
                     num_slots=4, num_blocks=64, model=str(directory),
                     engine_extra=("--dtype", "float64"))
    m = Mesh(cfg).start()
    try:
        yield m, directory, hf
    finally:
        m.stop()


def test_prefill_decode_handoff_over_grpc(pd_mesh):
    import openai
    from tokenizers import Tokenizer

    m, directory, hf = pd_mesh
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompt = random_prompt(60, seed=34)
    expected = hf_greedy(hf, prompt, 16)
    if hf.config.eos_token_id in expected:
        expected = expected[:expected.index(hf.config.eos_token_id)]
    client = openai.OpenAI(base_url=m.endpoints["gateway-http"] + "/v1", api_key="unused")
    out = client.completions.create(model=directory.name, prompt=tok.decode(prompt),
                                    max_tokens=16, temperature=0)
    assert out.choices[0].text.strip() == tok.decode(expected)
    pe, *ces = (m.endpoints[n] for n in m.engine_names)
    assert _stats(pe)["handoffs_out"] == 1
    assert sum(_stats(ce)["handoffs_in"] for ce in ces) == 1


def test_chat_completions_render_deepseek_v4s_encoding(mesh):
    """/v1/chat/completions: the gateway renders DeepSeek V4's chat encoding (the checkpoint
    directory has no chat_template) and tokenizes it with the checkpoint's tokenizer."""
    import openai
    from tokenizers import Tokenizer

    from kvmesh.chat_deepseek_v4 import encode_chat

    m, directory, hf = mesh
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w1 w2 w3"}]
    ids = tok.encode(encode_chat(messages), add_special_tokens=False).ids
    expected = hf_greedy(hf, ids, 10)
    if hf.config.eos_token_id in expected:
        expected = expected[:expected.index(hf.config.eos_token_id)]
    client = openai.OpenAI(base_url=m.endpoints["gateway-http"] + "/v1", api_key="unused")
    out = client.chat.completions.create(model=directory.name, messages=messages,
                                         max_tokens=10, temperature=0)
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content.strip() == tok.decode(expected)
