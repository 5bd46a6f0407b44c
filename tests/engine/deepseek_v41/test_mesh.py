"""A mesh of two DeepSeek V4.1 engines under prefill truncation (`kvmesh up --model DIR`'s
processes: real SeaweedFS, Valkey, kvstore, directory and gateway): a prompt's blocks
written through to the kvstore and its snapshot published by one engine make the other
engine's hit, equal to the reference's greedy tokens; `kvmesh up --pd` hands a request from
a prefill engine to a decode engine over gRPC."""

from __future__ import annotations

import pytest
import torch

from kvmesh.launch.mesh import Mesh, MeshConfig
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v4.test_engine import word_tokenizer
from tests.engine.deepseek_v4.test_mesh import _engine_call, _stats, _written_and_published
from tests.engine.deepseek_v41 import tiny
from tests.engine.deepseek_v41.test_engine import greedy, random_prompt

TRUNCATION = ("--truncation", "compact", "--keep-tokens", "134")


def _checkpoint(directory):
    cfg, meant = tiny.save_release("flash_geometry", directory, quantized=False, shards=1)
    word_tokenizer(directory)
    return V41Model(cfg, meant, torch.float64)


def _started(tmp_path_factory, label: str, engines: int, pd: bool, extra: tuple):
    """A mesh of `engines` engines serving a fresh tiny V4.1 checkpoint, under truncation;
    yields (mesh, checkpoint directory, the reference model) and stops it."""
    directory = tmp_path_factory.mktemp(label)
    m41 = _checkpoint(directory)
    cfg = MeshConfig(log_dir=tmp_path_factory.mktemp(label + "-mesh") / "logs", engines=engines, pd=pd,
                     num_slots=4, num_blocks=64, model=str(directory),
                     engine_extra=("--dtype", "float64", *extra, *TRUNCATION))
    m = Mesh(cfg).start()
    try:
        yield m, directory, m41
    finally:
        m.stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    yield from _started(tmp_path_factory, "tiny-v41", 2, False,
                        ("--fetch-deadline-ms", "5000", "--swa-fetch", "always"))


def test_one_engines_blocks_and_snapshot_make_the_others_hit(mesh):
    m, _, m41 = mesh
    a, b = (m.endpoints[n] for n in m.engine_names)
    first = random_prompt(300, seed=31)
    _engine_call(a, lambda c: c.complete(first, max_tokens=2, temperature=0.0, ignore_eos=True))
    _written_and_published(a)
    second = first[:256] + random_prompt(40, seed=32)      # the decoder's cut: 296 - 134 = 162
    ids, _, last = _engine_call(b, lambda c: c.complete(second, max_tokens=12, temperature=0.0,
                                                        ignore_eos=True))
    assert ids == greedy(m41, second, 12, keep=134)
    s = _stats(b)
    assert (s["block_hits_remote"], s["snapshot_hits"], s["peer_snapshot_fetches"]) == (1, 1, 1), \
        ({k: v for k, v in s.items() if v}, {k: v for k, v in _stats(a).items() if v})
    assert last.usage.cached_tokens == 128


@pytest.fixture(scope="module")
def pd_mesh(tmp_path_factory):
    """`kvmesh up --pd --model DIR`: engine-a prefills (396-row rings), two engines decode."""
    yield from _started(tmp_path_factory, "tiny-v41-pd", 3, True, ())


def test_prefill_decode_handoff_over_grpc(pd_mesh):
    import openai
    from tokenizers import Tokenizer

    m, directory, m41 = pd_mesh
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompt = random_prompt(200, seed=34)
    expected = greedy(m41, prompt, 10, keep=134)
    eos = m41.cfg.eos_token_ids[0]
    if eos in expected:
        expected = expected[:expected.index(eos)]
    client = openai.OpenAI(base_url=m.endpoints["gateway-http"] + "/v1", api_key="unused")
    out = client.completions.create(model=directory.name, prompt=tok.decode(prompt),
                                    max_tokens=10, temperature=0)
    assert out.choices[0].text.strip() == tok.decode(expected)
    pe, *ces = (m.endpoints[n] for n in m.engine_names)
    assert _stats(pe)["handoffs_out"] == 1
    assert sum(_stats(ce)["handoffs_in"] for ce in ces) == 1
    # logprobs come through the handoff too: the first token's from the prefill engine, the
    # rest from the decode engine, each the reference's log-softmax at its position
    full = greedy(m41, prompt, 10, keep=134)
    lp = client.completions.create(model=directory.name, prompt=tok.decode(prompt), max_tokens=10,
                                   temperature=0, logprobs=1).choices[0].logprobs
    assert 0 < len(lp.token_logprobs) <= 10
    for i, got in enumerate(lp.token_logprobs):
        ids = prompt + full[:i]
        ref = torch.log_softmax(m41.logits(torch.tensor(ids), keep=len(ids) - (200 - 134))[-1], -1)
        assert abs(got - float(ref[full[i]])) < 1e-4
