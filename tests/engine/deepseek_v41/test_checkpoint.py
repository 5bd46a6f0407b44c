"""DeepSeek V4.1 checkpoint directories in the release's format (names, shards, FP8 with
32 x 32 UE8M0 scales, FP4 routed experts): loading, `kvmesh score`, and load errors naming
the file and tensor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4.checkpoint import load_v41_checkpoint
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.score import load_model, score
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from tests.engine.deepseek_v41 import tiny

NAME = "flash_like"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v41")
    cfg, meant = tiny.save_release(NAME, directory)
    return directory, cfg, meant


def test_a_quantized_release_loads_as_the_weights_it_stands_for(release):
    directory, cfg, meant = release
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    model = load_model(directory, torch.float64)
    assert isinstance(model, V41Model) and model.cfg == cfg
    ids = tiny.prompt(NAME)
    want = V41Model(cfg, meant, torch.float64).logits(ids)
    assert (model.logits(ids) - want).abs().max() <= 1e-12
    unquantized = V41Model(cfg, tiny.weights(cfg, 0, torch.float32), torch.float32)
    assert (unquantized.logits(ids).double() - want).abs().max() > 1e-4   # FP8 / FP4 are there


def test_kvmesh_score_runs_a_v41_checkpoint(release):
    directory, cfg, meant = release
    ids = tiny.prompt(NAME)[:20].tolist()
    run = subprocess.run([sys.executable, "-m", "kvmesh.launch.cli", "score", "--model", str(directory),
                          "--ids", ",".join(map(str, ids)), "--dtype", "float64"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    want = score(V41Model(cfg, meant, torch.float64), ids)
    assert printed["argmax"] == want["argmax"]
    got = torch.tensor(printed["logprobs"][1:])
    assert (got - torch.tensor(want["logprobs"][1:])).abs().max() <= 1e-9
    assert "perplexity" in run.stderr


def _without(directory, tmp_path, drop: str):
    import shutil

    from safetensors.torch import load_file, save_file
    copy = tmp_path / "broken"
    shutil.copytree(directory, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    file = copy / index["weight_map"].pop(drop)
    tensors = load_file(file)
    del tensors[drop]
    save_file(tensors, str(file))
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    return copy


def test_a_missing_tensor_is_named_with_the_layer_role_that_needs_it(release, tmp_path):
    directory, _, _ = release
    broken = _without(directory, tmp_path, "layers.3.attn.indexer.wk.weight")
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.3\.attn\.indexer\.wk\.weight"
                       r".*layer 3 \(compress ratio 1, KV source, index source\)"):
        load_v41_checkpoint(broken)


def test_a_missing_scale_is_named(release, tmp_path):
    directory, _, _ = release
    broken = _without(directory, tmp_path, "layers.0.attn.wq_a.scale")
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight is torch\.float8_e4m3fn "
                       "without a scale tensor"):
        load_v41_checkpoint(broken)


def test_the_parts_it_does_not_serve_are_named_at_load_and_left_out(tmp_path, caplog):
    """A release's DSpark draft layers (mtp.*) and image routing biases are not read: the
    text model loads without them, and the load says what it leaves out."""
    from safetensors.torch import load_file, save_file

    _, meant = tiny.save_release(NAME, tmp_path, quantized=False, shards=1)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    tensors |= {"mtp.0.e_proj.weight": torch.zeros(4, 4), "mtp.0.norm.weight": torch.ones(4),
                "layers.0.ffn.gate.bias_vl": torch.zeros(4), "visual.patch.weight": torch.ones(2)}
    save_file(tensors, str(file))
    with caplog.at_level("WARNING"):
        cfg, weights = load_v41_checkpoint(tmp_path, torch.float64)
    assert weights.keys() == meant.keys()
    said = [r.getMessage() for r in caplog.records]
    assert any("the DSpark draft layers" in s and ": 2 tensors" in s for s in said), said
    assert any("routing biases" in s and ": 1 tensor" in s for s in said), said
    assert any("other tensors (such as visual.patch.weight): 1 tensor" in s for s in said), said


def test_a_gateway_renders_chat_in_deepseeks_encoding_for_a_v41_tokenizer(release):
    from kvmesh.services.gateway.openai_api.chat import deepseek_v4_template, load_template
    directory, _, _ = release
    (directory / "tokenizer.json").write_text("{}")   # only its place is read here
    assert load_template(str(directory / "tokenizer.json")) is deepseek_v4_template
