"""The DeepSeek V4 / V4.1 forward, ledgers and engine make every tensor on the device of the
model's weights, never on the process's default device (issue 41: the same code must run
on a GPU). The check runs on the CPU: with torch's default device set to `meta` (which holds
no data), a CPU model must compute exactly what it computes otherwise. A tensor built
without a device lands on meta there and either fails at the first op that meets a CPU
tensor or poisons the result; on a GPU it would be a CPU tensor in CUDA work."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_checkpoint, load_v41_checkpoint
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v4.test_engine import checkpoint, engine, random_prompt, word_tokenizer
from tests.engine.deepseek_v41 import tiny

META = torch.device("meta")


def test_the_v41_reference_forward_builds_on_the_weights_device():
    for name in ("flash_like", "yarn_hc4"):
        cfg = tiny.config(name)
        m = V41Model(cfg, tiny.weights(cfg), torch.float64)
        ids = tiny.prompt(name)
        want = m.logits(ids)
        with META:
            got = m.logits(ids)
            cut = m.logits(ids, keep=20, mode="mask")
        assert got.device.type == "cpu" and torch.equal(got, want), name
        assert torch.equal(cut, m.logits(ids, keep=20, mode="mask")), name


def _greedy(core: Engine, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    reqs = [core.add_request(p, params) for p in prompts]
    while core.has_work:
        core.step()
    return [r.output for r in reqs]


def _engine(model, directory, **settings) -> Engine:
    from kvmesh.services.engine.build import v4_tokenizer

    ecfg = EngineConfig(num_slots=4, max_running=4, num_blocks=64, dtype="float64",
                        swa_policy="zero", **settings)
    return Engine(model, ecfg, v4_tokenizer(directory, model.whole), name="device")


def _same_under_meta(model, directory, prompts, **settings) -> None:
    """The engine's outputs (prefill, batched decode, a prefix hit, and drafts where the
    settings ask) equal with the default device on meta and off it."""
    want = _greedy(_engine(model, directory, **settings), prompts)
    with META:
        core = _engine(model, directory, **settings)
        assert core.ledgers.data.device.type == "cpu"
        got = _greedy(core, prompts)
        again = _greedy(core, prompts[:1])          # the first prompt again: a prefix hit
    assert got == want and again == want[:1]
    assert core.stats()["cache_hit_tokens"] > 0


def test_the_v41_engine_builds_on_the_weights_device(tmp_path):
    cfg, _ = tiny.save_release("flash_geometry", tmp_path, quantized=False, shards=1,
                               kvmesh={"mtp_layers": 1})
    word_tokenizer(tmp_path)
    cfg, w = load_v41_checkpoint(tmp_path, torch.float64)
    model = V41Model(cfg, w, torch.float64, rows="exact")
    prompts = [random_prompt(300, 1), random_prompt(40, 2)]
    _same_under_meta(model, tmp_path, prompts, speculative="mtp:2", spec_policy="always")
    _same_under_meta(model, tmp_path, prompts, truncation="compact", keep_tokens=140,
                     speculative="ngram:3", spec_policy="always")


def test_the_v4_engine_builds_on_the_weights_device(tmp_path):
    checkpoint("mixed", tmp_path)
    cfg, w = load_checkpoint(tmp_path, torch.float64)
    model = V4Model(cfg, w, torch.float64, stored=True, rows="exact")
    ids = torch.tensor(random_prompt(200, 3))
    want = model.logits(ids)
    with META:
        assert torch.equal(model.logits(ids), want)
    _same_under_meta(model, tmp_path, [random_prompt(300, 1), random_prompt(40, 2)],
                     speculative="ngram:3", spec_policy="always")


def test_cuda_where_torch_sees_none_is_refused_naming_the_flag(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    tiny.save_release("flash_geometry", tmp_path, quantized=False, shards=1)
    word_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="--device cuda: no CUDA device"):
        engine(tmp_path, "--device", "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_v41_engine_on_cuda_gives_the_cpu_tokens(tmp_path):
    """scripts/gpu_check.sh: the same checkpoint served with --device cuda and on the CPU
    (float64, exact rings; with MTP drafts, a prefix hit and truncation): the same greedy
    tokens, and the first step's logits within 1e-9."""
    tiny.save_release("flash_geometry", tmp_path, quantized=False, shards=1,
                      kvmesh={"mtp_layers": 1})
    word_tokenizer(tmp_path)
    prompts = [random_prompt(300, 1), random_prompt(40, 2)]
    for flags in (["--speculative", "mtp:2", "--spec-policy", "always"],
                  ["--truncation", "compact", "--keep-tokens", "140"]):
        cpu, gpu = engine(tmp_path, *flags), engine(tmp_path, "--device", "cuda", *flags)
        assert gpu.ledgers.data.device.type == "cuda"
        assert _greedy(gpu, prompts) == _greedy(cpu, prompts)
        assert _greedy(gpu, prompts[:1]) == _greedy(cpu, prompts[:1])     # a prefix hit
    m_cpu, m_gpu = cpu.model, gpu.model
    ids = torch.tensor(prompts[0])
    assert (m_gpu.logits(ids).cpu() - m_cpu.logits(ids)).abs().max() <= 1e-9
