"""kvmesh's MTP module on a DeepSeek V4.1 engine (`"kvmesh": {"mtp_layers": 1}`, `--speculative
mtp:K`).

No outside implementation has this module (it is kvmesh's), so the tests hold what can be
held: the loader reads `kvmesh.mtp.0.*` (experts one by one, as the release names a layer's)
and names a missing tensor; every draft's logits equal the module run over the whole final
sequence at once, from the trunk's whole-sequence streams (chained drafts included); output
with MTP drafts is the reference's greedy output, token for token, with truncation off and
under `compact` (where the prompt's first rows have no decoder streams to draft from).
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.services.engine.model.deepseek_v4.v41_mtp import V41MtpModule
from kvmesh.services.engine.model.deepseek_v4.v41_names import mtp_shapes
from tests.engine.deepseek_v4.test_engine import engine, random_prompt, word_tokenizer
from tests.engine.deepseek_v41 import tiny
from tests.engine.deepseek_v41.test_engine import greedy, run
from tests.engine.mtp_drafts import recorded, without_tensor, worst_difference

TOKENS = 30


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v41-mtp")
    cfg, meant = tiny.save_release("flash_geometry", directory, quantized=False, shards=1,
                                   kvmesh={"mtp_layers": 1})
    word_tokenizer(directory)
    return directory, V41Model(cfg, meant, torch.float64)


def test_the_loader_reads_the_module_and_names_a_missing_tensor(saved, tmp_path):
    directory, m = saved
    cfg, weights = load_v41_checkpoint(directory, torch.float64)
    assert cfg.mtp_layers == 1
    got = {k: tuple(v.shape) for k, v in weights.items() if k.startswith("kvmesh.mtp.")}
    assert got == mtp_shapes(cfg) and "kvmesh.mtp.0.ffn.experts.w13" in got
    assert torch.equal(weights["kvmesh.mtp.0.ffn.experts.w2"], m.weights["kvmesh.mtp.0.ffn.experts.w2"])
    broken = without_tensor(directory, tmp_path, "kvmesh.mtp.0.e_proj.weight")
    with pytest.raises(CheckpointError, match="kvmesh.mtp.0.e_proj.weight .*MTP module"):
        load_v41_checkpoint(broken, torch.float64)


def test_drafts_equal_the_module_over_the_whole_sequence(saved, monkeypatch):
    directory, m = saved
    core = engine(directory, "--speculative", "mtp:3", "--spec-policy", "always")
    prompt = random_prompt(150, 1)
    (output,), seen = recorded(monkeypatch, V41MtpModule, lambda: run(core, [prompt], TOKENS))
    assert output == greedy(m, prompt, TOKENS)                     # lossless
    stats = core.stats()
    assert len(seen) >= 4 and stats["spec_drafted_tokens"] > 0     # (misses back off)
    tokens = torch.tensor(prompt + output)
    trunk, _ = core.model.final_streams(tokens)
    worst, chained = worst_difference(V41MtpModule(core.model), trunk, tokens, seen)
    assert chained > 0 and worst <= 1e-9, worst


def test_mtp_under_truncation_is_the_truncated_reference(saved):
    directory, m = saved
    prompt = random_prompt(300, 2)
    core = engine(directory, "--speculative", "mtp:2", "--spec-policy", "always",
                  "--truncation", "compact", "--keep-tokens", "140", "--long-prefill-chunk", "64")
    assert run(core, [prompt], TOKENS) == [greedy(m, prompt, TOKENS, keep=140)]
    assert core.stats()["spec_verify_steps"] > 0


def test_mtp_needs_the_module(tmp_path):
    tiny.save_release("flash_geometry", tmp_path, quantized=False, shards=1)
    word_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="kvmesh's MTP module .*kvmesh train-mtp"):
        engine(tmp_path, "--speculative", "mtp:2")
