"""A DeepSeek V4.1 engine split over 2 gloo ranks in lockstep (core/lockstep.py) with kvmesh's
MTP module drafting and Engram layers: both ranks emit the same events and draft alike, and
the tokens are those of one process's engine over the unsplit model (greedy and seeded, a
prefix hit). The MTP block runs replicated on every rank from the split model's streams."""

from __future__ import annotations

import pickle

import pytest
import torch

from kvmesh.services.engine import ranks
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core.engine import Engine
from kvmesh.services.engine.model.deepseek_v4.parallel import (
    Groups,
    ParallelV41Model,
    shard_weights,
)
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model
from kvmesh.tokenizer import ByteTokenizer
from tests.engine.deepseek_v4.test_lockstep import GREEDY, SEEDED, lead_or_follow, prompt
from tests.engine.deepseek_v41 import tiny

NAME = "tiny-v41"


def model_config():
    # ratio-2 and ratio-1 sources, a candidate source; Engram on a source and the first
    # decoder layer; the vocabulary above the byte tokenizer's 259 ids
    cfg = tiny.config("flash_like", vocab_size=512, kvmesh={"mtp_layers": 1},
                      **tiny.engram_fields([1, 3]))
    return cfg, tiny.weights(cfg, seed=3)


def engine_config() -> EngineConfig:
    return EngineConfig(dtype="float64", num_slots=4, num_blocks=24, max_batched_tokens=128,
                        swa_policy="full", speculative="mtp:2", spec_policy="always")


def scenario(engine) -> dict:
    """Two requests together, then one that shares the first's prompt: tokens and drafts."""
    tokens: dict[str, list[int]] = {}
    drafted = [0]

    def drain():
        while engine.has_work:
            for e in engine.step():
                tokens.setdefault(e.request_id, []).extend(e.token_ids)
                drafted[0] += e.drafted

    first = prompt(300, 1)
    engine.add_request(first, GREEDY, "greedy")
    engine.add_request(prompt(150, 2), SEEDED, "seeded")
    drain()
    hit = engine.add_request(first + prompt(40, 4), GREEDY, "hit")
    drain()
    return {"tokens": tokens, "drafted": drafted[0], "cached": hit.cached_tokens}


def rank_main(split, out: str) -> dict:
    cfg, weights = model_config()
    model = ParallelV41Model(cfg, shard_weights(cfg, weights, split), torch.float64, split,
                             Groups(split), rows="exact")
    engine = Engine(model, engine_config(), ByteTokenizer(), NAME)
    return lead_or_follow(engine, split, out, scenario)


@pytest.mark.timeout(240)    # ranks out of step meet in mismatched collectives: they hang
def test_a_split_v41_engine_drafts_with_its_mtp_module_as_one_process_does(tmp_path):
    cfg, weights = model_config()
    alone = scenario(Engine(V41Model(cfg, weights, torch.float64, rows="exact"), engine_config(),
                            ByteTokenizer(), NAME))
    split = ranks.run(rank_main, (str(tmp_path),), 2, 1)
    with open(tmp_path / "rank1.pkl", "rb") as f:
        assert pickle.load(f)[0] == split["tokens"]        # the ranks stayed in step
    assert split["tokens"] == alone["tokens"]
    assert all(len(t) == 10 for t in split["tokens"].values())
    assert split["drafted"] == alone["drafted"] > 0
    assert split["cached"] == alone["cached"] == 256
