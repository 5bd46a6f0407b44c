"""The full forward against transformers' DeepseekV4ForCausalLM, on four tiny random configs.

float64: every position's log-probability within 1e-6 of transformers' (it is bitwise equal
today: the fp32 steps are replicated). float32: within FP32_TOL, and the argmax identical
wherever transformers' top-2 margin exceeds it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4.score import load_model, score
from tests.engine.deepseek_v4 import tiny

FP64_TOL = 1e-6
FP32_TOL = 2e-4

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(tiny.CONFIGS))
def saved(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = tiny.save(request.param, directory)
    return request.param, directory, model


def test_float64_logprobs_match_transformers_at_every_position(saved):
    name, directory, hf = saved
    ids = tiny.prompt(name)
    want, want_logits = tiny.hf_logprobs(hf, ids, torch.float64)
    ours = load_model(directory, torch.float64)
    got_logits = ours.logits(ids)
    got = torch.tensor(score(ours, ids.tolist())["logprobs"][1:], dtype=torch.float64)
    assert (got - want).abs().max().item() <= FP64_TOL
    assert (got_logits - want_logits).abs().max().item() <= FP64_TOL


def test_float32_logprobs_within_tolerance_and_argmax_where_margin_allows(saved):
    name, directory, hf = saved
    ids = tiny.prompt(name)
    want, want_logits = tiny.hf_logprobs(hf, ids, torch.float32)
    result = score(load_model(directory, torch.float32), ids.tolist())
    got = torch.tensor(result["logprobs"][1:], dtype=torch.float64)
    assert (got - want).abs().max().item() <= FP32_TOL
    top2 = want_logits.double().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > FP32_TOL
    assert clear.sum() > len(ids) // 2
    got_argmax = torch.tensor(result["argmax"])
    assert torch.equal(got_argmax[clear], want_logits.argmax(dim=-1)[clear])


def test_kvmesh_score_prints_the_same_logprobs(tmp_path):
    name, directory = "mixed", tmp_path / "mixed"
    hf = tiny.save(name, directory)
    ids = tiny.prompt(name)[:24]
    want, _ = tiny.hf_logprobs(hf, ids, torch.float64)
    run = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "score", "--model", str(directory),
                          "--dtype", "float64", "--ids", ",".join(map(str, ids.tolist()))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["ids"] == ids.tolist() and out["logprobs"][0] is None
    assert len(out["argmax"]) == len(ids)
    got = torch.tensor(out["logprobs"][1:], dtype=torch.float64)
    assert (got - want).abs().max().item() <= FP64_TOL
    assert "perplexity" in run.stderr


def test_kvmesh_score_text_through_a_trained_tokenizer_json(tmp_path):
    """A BPE tokenizer.json trained with `tokenizers`, DeepSeek's special tokens added: text
    is scored as begin-of-sentence + its ids, the same as --ids of those ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from kvmesh.chat_deepseek_v4 import BOS, SPECIAL_TOKENS
    directory = tmp_path / "mixed"
    tiny.save("mixed", directory)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=[BOS, "[UNK]"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.add_special_tokens([t for t in SPECIAL_TOKENS if t != BOS])
    assert tok.token_to_id(BOS) == 0 and tok.get_vocab_size() <= tiny.BASE["vocab_size"]
    tok.save(str(directory / "tokenizer.json"))
    run = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "score", "--model", str(directory),
                          "the lazy fox"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["ids"] == [0] + tok.encode("the lazy fox", add_special_tokens=False).ids
    by_ids = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "score", "--model",
                             str(directory), "--ids", ",".join(map(str, out["ids"]))],
                            capture_output=True, text=True, timeout=120)
    assert json.loads(by_ids.stdout) == out
