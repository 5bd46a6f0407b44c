"""config.json in both published forms, read as transformers' DeepseekV4Config reads it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvmesh.services.engine.model.deepseek_v4.config import (
    CSA,
    HASH,
    HCA,
    MOE,
    SLIDING,
    config_from_dict,
    read_config,
)
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from tests.engine.deepseek_v4 import tiny

FLASH = Path(__file__).resolve().parents[3] / "configs" / "deepseek-v4-flash.json"
KIND = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA,
        "heavily_compressed_attention": HCA}


def _as_transformers_reads_it(raw: dict):
    from transformers import DeepseekV4Config
    return DeepseekV4Config(**raw)


@pytest.mark.parametrize("name", sorted(tiny.CONFIGS))
def test_layer_schedule_rates_and_rope_match_transformers(name):
    raw = {**tiny.BASE, **tiny.CONFIGS[name][0]}
    ours, hf = config_from_dict(raw), _as_transformers_reads_it(raw)
    assert ours.layer_kinds == tuple(KIND[t] for t in hf.layer_types)
    assert ours.mlp_kinds == tuple(HASH if t == "hash_moe" else MOE for t in hf.mlp_layer_types)
    assert (ours.csa_rate, ours.hca_rate) == (hf.compress_rates["compressed_sparse_attention"],
                                              hf.compress_rates["heavily_compressed_attention"])
    assert ours.main_rope.dim == ours.compress_rope.dim == hf.qk_rope_head_dim
    assert ours.compress_rope.theta == hf.rope_parameters["compress"]["rope_theta"]
    compress = hf.rope_parameters["compress"]
    assert (ours.compress_rope.yarn is not None) == (compress["rope_type"] == "yarn")


def test_deepseek_flash_config_json():
    cfg = read_config(FLASH)
    assert cfg.num_layers == 43 and cfg.layer_kinds[:2] == (SLIDING, SLIDING)
    assert cfg.layer_kinds[2::2] == (CSA,) * 21 and cfg.layer_kinds[3::2] == (HCA,) * 20
    assert cfg.mlp_kinds[:3] == (HASH,) * 3 and set(cfg.mlp_kinds[3:]) == {MOE}
    assert (cfg.head_dim, cfg.window, cfg.csa_rate, cfg.hca_rate) == (512, 128, 4, 128)
    y = cfg.compress_rope.yarn
    assert (y.factor, y.original_max_position) == (16.0, 65536)
    assert cfg.compress_rope.scaling == 1.0  # DeepSeek's flat yarn: attention factor forced to 1
    assert cfg.main_rope.yarn is None and cfg.main_rope.theta == 10000.0


def test_nested_yarn_without_attention_factor_takes_yarns_mscale():
    cfg = config_from_dict({**tiny.BASE, **tiny.CONFIGS["topk_nested_yarn"][0]})
    assert cfg.compress_rope.scaling == pytest.approx(0.1 * math.log(8.0) + 1)


@pytest.mark.parametrize("change, words", [
    ({"model_type": "llama"}, "model_type 'llama' is not DeepSeek V4"),
    ({"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2},
     "layer_types: unknown type(s) ['full_attention']"),
    ({"compress_ratios": [0, 8], "num_hidden_layers": 2}, "compress_ratios[1] = 8"),
    ({"num_hidden_layers": "4"}, "'num_hidden_layers' must be an integer"),
    ({"num_key_value_heads": 8}, "num_key_value_heads must be 1"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn needs 'original_max_position_embeddings'"),
])
def test_bad_config_fields_are_named(tmp_path, change, words):
    (tmp_path / "config.json").write_text(json.dumps({**tiny.BASE, "num_hidden_layers": 2,
                                                      **change}))
    with pytest.raises(CheckpointError) as err:
        read_config(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value) and words in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_and_unparsable_config(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable as JSON"):
        read_config(tmp_path)
