"""DeepSeek V4.1's configuration and full-sequence reference forward (v41_config.py,
v41_forward.py): the layer roles of the released layout, the refusals, causality, the
two-level top-k against a brute-force reading of its rule, and the pieces where V4.1 and V4
compute the same thing agreeing with V4's transformers-pinned modules."""

from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.model.deepseek_v4 import compressor as v4_compressor
from kvmesh.services.engine.model.deepseek_v4.errors import CheckpointError
from kvmesh.services.engine.model.deepseek_v4.forward import RopeTables
from kvmesh.services.engine.model.deepseek_v4.v41_config import v41_config_from_dict
from kvmesh.services.engine.model.deepseek_v4.v41_forward import (
    V41Model,
    compress,
)
from kvmesh.services.engine.model.deepseek_v4.v41_index import (
    candidate_blocks,
    index_query,
    index_scores,
    select,
)
from tests.engine.deepseek_v41 import tiny

# DeepSeek-V4.1-Flash's text_config as published (sizes only; the layer roles are the point)
FLASH = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
         "vision_config": {"num_hidden_layers": 32},
         "text_config": {"num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 64,
                         "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
                         "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
                         "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
                         "kv_source_layer_ids": [2, 8, 14, 20],
                         "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
                         "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048,
                         "candidate_block_size": 8, "index_n_heads": 32, "index_head_dim": 128,
                         "index_topk": 512, "n_routed_experts": 384, "num_experts_per_tok": 6,
                         "moe_intermediate_size": 2304, "rms_norm_eps": 1e-20,
                         "rope_theta": 10000, "compress_rope_theta": 160000,
                         "rope_scaling": {"type": "yarn", "factor": 16,
                                          "original_max_position_embeddings": 65536,
                                          "beta_fast": 32, "beta_slow": 1},
                         "engram_layer_ids": [], "num_nextn_predict_layers": 3}}


def test_flash_layer_roles_follow_the_published_table():
    cfg = v41_config_from_dict(FLASH)
    assert cfg.num_layers == 40 and cfg.ratios[:2] == (0, 0)
    table = {}
    for layer in range(40):
        if cfg.ratio(layer):
            table[layer] = (cfg.ratio(layer), cfg.kv_source_of(layer), cfg.index_source_of(layer))
    assert table[2] == (2, 2, 2) and table[7] == (2, 2, 2)
    assert table[8] == (2, 8, 8) and table[19] == (2, 14, 14)
    assert table[20] == (1, 20, 20) and table[23] == (1, 20, 20)
    assert table[24] == (1, 20, 24) and table[31] == (1, 20, 28) and table[39] == (1, 20, 36)
    assert [i for i in range(40) if cfg.uses_candidates(i) and i in cfg.index_sources] == [24, 28, 32, 36]
    assert cfg.decoder_start == 20    # encoder 0-19, decoder 20-39 (20's compressor sees all)
    assert cfg.rope(0) is cfg.main_rope and cfg.rope(2) is cfg.compress_rope
    assert cfg.compress_rope.yarn.factor == 16 and cfg.compress_rope.theta == 160000


def _flash(**text):
    return {**FLASH, "text_config": {**FLASH["text_config"], **text}}


@pytest.mark.parametrize("raw, words", [
    (_flash(engram_layer_ids=[1, 14]), "engram_max_ngram_size = 0: must be at least 2"),
    (_flash(kv_source_layer_ids=[1, 8, 14, 20]), "kv_source_layer_ids names layer 1"),
    (_flash(kv_source_layer_ids=[8, 14, 20]), "layer 2 reads a compressed cache"),
    (_flash(kv_source_layer_ids=[2, 8, 14]), "layer 20 has compress_ratios = 1, its KV source"),
    (_flash(index_source_layer_ids=[2, 8, 14, 24]), "kv_source_layer_ids names layer 20"),
    (_flash(candidate_source_layer_id=21), "candidate_source_layer_id 21"),
    (_flash(candidate_source_layer_id=14), "index source 20 comes after candidate"),
    (_flash(candidate_topk_blocks=0), "candidate_topk_blocks"),
    (_flash(compress_ratios=[0, 0, 2]), "compress_ratios must list at least"),
    (_flash(num_hash_layers=3), "num_hash_layers"),
    (_flash(model_type="deepseek_v4"), "model_type"),
])
def test_unservable_configs_are_refused_naming_the_field(raw, words):
    if raw["text_config"].get("model_type") == "deepseek_v4":
        raw = {**raw, "model_type": "deepseek_v4"}
    with pytest.raises(CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
        v41_config_from_dict(raw)


@pytest.fixture(scope="module", params=list(tiny.CONFIGS))
def model(request):
    cfg = tiny.config(request.param)
    return request.param, V41Model(cfg, tiny.weights(cfg), torch.float64)


def test_a_prefix_computes_what_the_whole_sequence_computes_for_it(model):
    """No token sees a later one: compressors close a group only when all its tokens are in,
    and the indexer's top-k breaks ties by position, not by how many entries exist."""
    name, m = model
    ids = tiny.prompt(name)
    whole = m.logits(ids)
    assert whole.isfinite().all() and whole.std() > 0.05
    for k in (1, 2, 3, 9, 17, len(ids) // 2, len(ids) - 1):
        assert (m.logits(ids[:k]) - whole[:k]).abs().max() <= 1e-12, k


def _brute_candidates(scores, seen, topk_blocks, block_size):
    s, t = scores.shape
    out = torch.zeros(s, t, dtype=torch.bool)
    for i in range(s):
        visible = [j for j in range(t) if seen[i, j]]
        if not visible:
            continue
        blocks = {}
        for j in visible:
            blocks.setdefault(j // block_size, []).append(float(scores[i, j]))
        newest = visible[-1] // block_size
        ranked = sorted(blocks, key=lambda b: (b != newest, -max(blocks[b]), b))
        for b in ranked[:topk_blocks]:
            for j in visible:
                if j // block_size == b:
                    out[i, j] = True
    return out


@pytest.mark.parametrize("seed", range(6))
def test_candidate_blocks_follow_their_rule(seed):
    g = torch.Generator().manual_seed(seed)
    s, t, block, keep = 12, 23, 4, 2
    scores = torch.randint(0, 4, (s, t), generator=g).double()    # small range: many ties
    counts = torch.randint(0, t + 1, (s,), generator=g)
    seen = torch.arange(t).view(1, -1) < counts.view(-1, 1)
    got = candidate_blocks(scores, seen, keep, block)
    assert torch.equal(got, _brute_candidates(scores, seen, keep, block))
    chosen = select(scores, seen & got, 3)
    assert not (chosen & ~got).any() and (chosen.sum(-1) <= 3).all()


def test_a_candidate_level_that_keeps_every_block_changes_nothing():
    ids = tiny.prompt("flash_like")
    plain = tiny.config("flash_like", candidate_source_layer_id=None)
    w = tiny.weights(plain)
    reference = V41Model(plain, w, torch.float64).logits(ids)
    keeps_all = tiny.config("flash_like", candidate_topk_blocks=100)
    assert (V41Model(keeps_all, w, torch.float64).logits(ids) - reference).abs().max() <= 1e-12
    narrow = tiny.config("flash_like", candidate_topk_blocks=1, candidate_block_size=2)
    assert (V41Model(narrow, w, torch.float64).logits(ids) - reference).abs().max() > 1e-4


def test_the_compressor_is_v4s_unbiased_non_overlapping_pool():
    """Where V4 and V4.1 coincide: a ratio-m source's entries are V4's HCA pool with a zero
    position bias, and its selection (no candidate level) is V4's indexer over the same keys."""
    cfg = tiny.config("yarn_hc4")
    w = tiny.weights(cfg, dtype=torch.float32)
    attn = {k[len("layers.0.attn."):]: v for k, v in w.items() if k.startswith("layers.0.attn.")}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(27, cfg.hidden_size, generator=g)
    tables = RopeTables(cfg, torch.float32)
    mine = compress(cfg, attn, x, tables, 0)
    cw = {k[len("compressor."):]: v for k, v in attn.items() if k.startswith("compressor.")}
    cw["ape"] = torch.zeros(2, cfg.head_dim)
    theirs = v4_compressor.pool(x, cw, 2, False, lambda p: tables.at(cfg.compress_rope, p),
                                cfg.rms_eps)
    assert theirs.entries.shape == mine.entries.shape == (13, cfg.head_dim)
    assert (theirs.entries - mine.entries).abs().max() <= 1e-5

    q_res = torch.randn(27, cfg.q_lora_rank, generator=g)
    positions = torch.arange(27)
    iw = {k[len("indexer."):]: v for k, v in attn.items() if k.startswith("indexer.")}
    scores = index_scores(index_query(cfg, iw, x, q_res, positions, tables), mine.keys)
    seen = v4_compressor.visible(positions, 13, 2)
    chosen = select(scores, seen, cfg.index_topk)
    v4_chosen = v4_compressor.index_select(x, q_res, mine.keys, iw, positions, 2, cfg.index_topk,
                                           lambda p: tables.at(cfg.compress_rope, p))
    ordered = scores.masked_fill(~seen, float("-inf")).sort(dim=-1, descending=True).values
    k = cfg.index_topk
    clear = (ordered[:, k - 1] - ordered[:, k]).abs() > 1e-4 if ordered.shape[1] > k else \
        torch.ones(27, dtype=torch.bool)
    assert clear.sum() > 10
    assert torch.equal(chosen[clear], v4_chosen[clear])


def test_float64_keeps_float64_where_v4_rounds_to_fp32():
    """V4.1's reductions run in the model's dtype above fp32 (v41_forward.wide): a float64
    model's logits for one token alone and inside a longer batch agree to 1e-12."""
    cfg = tiny.config("flash_like", compress_ratios=[0] * 7, kv_source_layer_ids=[],
                      index_source_layer_ids=[], candidate_source_layer_id=None)
    m = V41Model(cfg, tiny.weights(cfg), torch.float64)
    ids = tiny.prompt("flash_like")
    assert (m.logits(ids[:1]) - m.logits(ids)[:1]).abs().max() <= 1e-12
