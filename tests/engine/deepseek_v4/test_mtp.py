"""MTP drafts on a DeepSeek V4 engine (`--speculative mtp:K`).

transformers builds no MTP module (it drops `mtp.*`), so there is no outside oracle for the
module itself. The tests hold what can be held: the loader reads DeepSeek-named `mtp.N.*`
tensors (and names a missing one); every draft's logits equal the module run over the whole
final sequence at once (the trunk's full forward gives its streams), the chained ones
included; and output with MTP drafts is transformers' greedy output, token for token.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.services.engine.core.sampling import SamplingParams
from kvmesh.services.engine.model.deepseek_v4 import names
from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_checkpoint
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.mtp import MtpModule
from tests.engine.deepseek_v4 import tiny
from tests.engine.deepseek_v4.test_engine import checkpoint, engine, hf_greedy, run
from tests.engine.mtp_drafts import recorded, without_tensor, worst_difference

pytest.importorskip("transformers")
TOKENS = 40


def add_mtp(directory, cfg, seed: int = 5) -> None:
    """Random MTP tensors in DeepSeek's naming (per-expert w1 / w2 / w3) in the checkpoint."""
    g = torch.Generator().manual_seed(seed)
    state = load_file(str(directory / "model.safetensors"))
    for name, shape in names.mtp_shapes(cfg).items():
        if name.endswith("experts.w13") or name.endswith("experts.w2"):
            base = name[: -len("w13" if name.endswith("w13") else "w2")]
            w = torch.randn(shape, generator=g) * 0.03
            for e in range(shape[0]):
                if name.endswith("w13"):
                    half = shape[1] // 2
                    state[f"{base}{e}.w1.weight"] = w[e, :half].contiguous()
                    state[f"{base}{e}.w3.weight"] = w[e, half:].contiguous()
                else:
                    state[f"{base}{e}.w2.weight"] = w[e].contiguous()
            continue
        value = torch.randn(shape, generator=g) * (0.15 if len(shape) < 2 else 0.03)
        if name.endswith(("norm.weight", "hc_head_scale")) or name.endswith("_scale"):
            value += 1.0
        state[name] = value
    save_file(state, str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixed-mtp")
    hf = checkpoint("mixed", directory)
    cfg, _ = load_checkpoint(directory, torch.float32)
    add_mtp(directory, cfg)
    return directory, hf


def test_the_loader_reads_mtp_tensors_and_names_a_missing_one(saved, tmp_path):
    directory, _ = saved
    cfg, weights = load_checkpoint(directory, torch.float64)
    want = names.mtp_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in weights.items() if k.startswith("mtp.")} == want
    broken = without_tensor(directory, tmp_path, "mtp.0.h_proj.weight")
    with pytest.raises(CheckpointError, match="missing tensor mtp.0.h_proj.weight .*MTP module 0"):
        load_checkpoint(broken, torch.float32)


def test_mtp_drafts_equal_the_module_over_the_whole_sequence(saved, monkeypatch):
    directory, hf = saved
    core = engine(directory, "--speculative", "mtp:3", "--spec-policy", "always")
    prompt = tiny.prompt("mixed").tolist()
    (output,), seen = recorded(monkeypatch, MtpModule, lambda: run(core, [prompt], TOKENS))
    assert output == hf_greedy(hf, prompt, TOKENS)                # lossless
    assert len(seen) > 5 and core.stats()["spec_drafted_tokens"] > 0
    tokens = torch.tensor(prompt + output)
    worst, _ = worst_difference(MtpModule(core.model), core.model.final_streams(tokens), tokens,
                                seen)
    assert worst <= 1e-6, worst


def test_mtp_needs_mtp_tensors(tmp_path):
    from kvmesh.errors import InvalidArgument

    checkpoint("mixed", tmp_path)
    with pytest.raises(InvalidArgument, match="mtp needs MTP weights"):
        engine(tmp_path, "--speculative", "mtp:2")


def test_sampled_requests_with_mtp_drafts_run(saved):
    directory, _ = saved
    core = engine(directory, "--speculative", "mtp:2", "--spec-policy", "always")
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    req = core.add_request(tiny.prompt("mixed").tolist(), params)
    while core.has_work:
        core.step()
    core.check_integrity()
    assert len(req.output) == 20 and core.stats()["spec_verify_steps"] > 0
