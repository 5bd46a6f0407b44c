"""Checkpoint directories: both namings, shards, FP8 and FP4, and every load error as one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_checkpoint
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.score import load_model, score, tokenize
from tests.engine.deepseek_v4 import tiny

pytest.importorskip("transformers")
NAME = "yarn_hc4"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    return tiny.save(NAME, directory), directory


def _logprobs(directory, ids):
    return torch.tensor(score(load_model(directory, torch.float64), ids.tolist())["logprobs"][1:])


@pytest.mark.parametrize("naming, shards, form", [("deepseek", 2, "deepseek"),
                                                  ("transformers", 3, "transformers")])
def test_renamed_and_sharded_copies_score_the_same(hf, tmp_path, naming, shards, form):
    model, saved = hf
    ids = tiny.prompt(NAME)
    tiny.resave(model, tmp_path, naming, shards=shards, config_form=form)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert torch.equal(_logprobs(tmp_path, ids), _logprobs(saved, ids))


@pytest.mark.parametrize("naming, fp8, fp4", [("deepseek", "float32", False),
                                              ("deepseek", "ue8m0", False),
                                              ("transformers", "float32", False),
                                              ("deepseek", "ue8m0", True)])
def test_quantized_copies_score_as_their_dequantized_weights(hf, tmp_path, naming, fp8, fp4):
    model, _ = hf
    ids = tiny.prompt(NAME)
    tiny.resave(model, tmp_path / "q", naming, shards=2, fp8=fp8, fp4_experts=fp4)
    stored = {}
    for f in (tmp_path / "q").glob("*.safetensors"):
        stored.update(load_file(f))
    assert any(v.dtype == torch.float8_e4m3fn for v in stored.values())
    assert fp4 == any(v.dtype == torch.int8 for v in stored.values())
    reference = tiny.dequantized_copy(model, naming, fp8, fp4)
    want, _ = tiny.hf_logprobs(reference, ids, torch.float64)
    got = _logprobs(tmp_path / "q", ids)
    assert (got - want).abs().max().item() <= 1e-6
    plain, _ = tiny.hf_logprobs(model, ids, torch.float64)
    assert (got - plain).abs().max().item() > 1e-6  # the quantization is really there


def _broken(hf, tmp_path, edit):
    """A copy of the saved checkpoint with `edit(state) -> state` applied to its tensors."""
    _, saved = hf
    shutil.copytree(saved, tmp_path / "c")
    state = edit(load_file(saved / "model.safetensors"))
    save_file(state, str(tmp_path / "c" / "model.safetensors"))
    return tmp_path / "c"


def _error(directory) -> str:
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(directory, torch.float32)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_missing_tensor_names_it_and_its_shape(hf, tmp_path):
    d = _broken(hf, tmp_path, lambda s: {k: v for k, v in s.items()
                                         if k != "model.layers.1.attn.wkv.weight"})
    msg = _error(d)
    assert "missing tensor layers.1.attn.wkv.weight (expected shape [32, 64])" in msg
    assert "layer 1 (csa attention" in msg


def test_missing_expert_is_named(hf, tmp_path):
    d = _broken(hf, tmp_path, lambda s: {k: v for k, v in s.items()
                                         if k != "model.layers.2.ffn.experts.3.w3.weight"})
    assert "missing tensor layers.2.ffn.experts.3.w3.weight" in _error(d)


def test_wrong_shape_names_file_tensor_and_expected_shape(hf, tmp_path):
    def edit(s):
        s["model.layers.0.attn.wq_a.weight"] = torch.zeros(31, 64)
        return s
    msg = _error(_broken(hf, tmp_path, edit))
    assert "model.safetensors: tensor model.layers.0.attn.wq_a.weight has shape [31, 64], " \
           "expected [32, 64]" in msg


def test_integer_weight_is_refused(hf, tmp_path):
    def edit(s):
        s["model.norm.weight"] = torch.zeros(64, dtype=torch.int32)
        return s
    assert "model.norm.weight has dtype torch.int32, expected a floating-point type" in \
        _error(_broken(hf, tmp_path, edit))


def test_fp8_without_its_scale_is_refused(hf, tmp_path):
    def edit(s):
        s["model.layers.0.attn.wq_a.weight"] = s["model.layers.0.attn.wq_a.weight"].to(
            torch.float8_e4m3fn)
        return s
    assert "model.layers.0.attn.wq_a.weight is torch.float8_e4m3fn without a scale tensor" in \
        _error(_broken(hf, tmp_path, edit))


def test_unsupported_quantization_and_unknown_layer_type(hf, tmp_path):
    _, saved = hf
    for change, words in [({"quantization_config": {"quant_method": "gptq", "bits": 4}},
                           "unsupported quantization (quant_method 'gptq'"),
                          ({"layer_types": ["sliding_attention", "mamba", "sliding_attention",
                                            "sliding_attention"]},
                           "layer_types: unknown type(s) ['mamba']")]:
        d = tmp_path / str(len(words))
        shutil.copytree(saved, d)
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**raw, **change}))
        assert words in _error(d)


def test_no_weights_and_missing_shard(hf, tmp_path):
    (tmp_path / "e").mkdir()
    shutil.copy(hf[1] / "config.json", tmp_path / "e")
    assert "no model.safetensors or model.safetensors.index.json" in _error(tmp_path / "e")
    tiny.resave(hf[0], tmp_path / "s", "deepseek", shards=2)
    (tmp_path / "s" / "model-00002-of-00002.safetensors").unlink()
    assert "lists model-00002-of-00002.safetensors, which is not in" in _error(tmp_path / "s")


def test_tokenizer_larger_than_the_vocabulary_is_refused(hf, tmp_path):
    from tokenizers import Tokenizer, models
    _, saved = hf
    cfg, _ = load_checkpoint(saved, torch.float32)
    d = tmp_path / "t"
    shutil.copytree(saved, d)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(150)}, unk_token="w0")).save(
        str(d / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="has 150 tokens, more than the model's vocab_size 100"):
        tokenize(d, "w1 w2", cfg)


def test_checkpoint_larger_than_memory_fails_before_reading_a_tensor(hf, tmp_path):
    """V4-Flash's config over a tiny file: the size check comes before any shape or read."""
    from pathlib import Path
    flash = Path(__file__).resolve().parents[3] / "configs" / "deepseek-v4-flash.json"
    (tmp_path / "big").mkdir()
    shutil.copy(flash, tmp_path / "big" / "config.json")
    shutil.copy(hf[1] / "model.safetensors", tmp_path / "big")
    msg = _error(tmp_path / "big")
    assert "the weights take" in msg and "GiB as torch.float32, more than the" in msg
