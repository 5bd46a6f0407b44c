"""A request hashes each of its blocks once (admission, commits and a prefetch share one
chain); the model fingerprint is computed once per config, not per admission."""

from __future__ import annotations

import json

import pytest

from kvmesh import cachekeys
from services.engine import config as config_mod
from services.engine.cache.prefetch import Prefetched
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()          # block 16, W 16; KEEP 22
BS = CFG.block_size
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture
def hashed(monkeypatch) -> list[tuple[int, ...]]:
    """Token runs of every block hash computed while the test runs."""
    calls: list[tuple[int, ...]] = []
    real = cachekeys.block_hash

    def counting(parent, token_ids, fingerprint, salt=""):
        calls.append(tuple(token_ids))
        return real(parent, token_ids, fingerprint, salt)

    monkeypatch.setattr(cachekeys, "block_hash", counting)
    return calls


def blocks_of(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[k * BS:(k + 1) * BS]) for k in range(n)]


def serve(engine, prompt, prefetched=None):
    seq = engine.add_request(prompt, PARAMS, prefetched=prefetched)
    run_to_completion(engine)
    return seq


def test_cold_request_hashes_each_block_once(hashed):
    engine = make_engine(CFG, truncation="compact", keep_tokens=22)
    prompt = random_prompt(100, 3)
    seq = serve(engine, prompt)
    # 100 + 20 tokens, the last sampled one never computed: 119 // 16 = 7 complete blocks.
    # Admission hashes the 4 within the cap (100 - 22), commits the other 3, none twice.
    assert hashed == blocks_of(seq.tokens, 7)
    assert seq.block_hashes == cachekeys.chain(seq.tokens[:7 * BS], BS, CFG.fingerprint())


def test_warm_request_and_prefetch_reuse_the_chain(hashed):
    engine = make_engine(CFG, truncation="compact", keep_tokens=22)
    serve(engine, random_prompt(100, 3))
    hashed.clear()
    prompt = random_prompt(100, 3)[:64] + random_prompt(36, 4)
    view = engine.cache.local_view(prompt, "")                  # what a prefetch computes
    assert view.n_local == 4 and hashed == blocks_of(prompt, 4)
    seq = serve(engine, prompt, Prefetched(hashes=view.hashes))
    assert seq.cached_tokens == 64
    assert hashed == blocks_of(seq.tokens, 7)                    # 4 by the prefetch, 3 commits


def test_fingerprint_is_computed_once_per_config(monkeypatch):
    cfg = small_test_config()                 # a new config object: fingerprinted once, here
    want = cachekeys.model_fingerprint(json.loads(cfg.to_json()))   # what a gateway computes

    def recomputed(fields):
        raise AssertionError("model fingerprint recomputed after construction")

    monkeypatch.setattr(config_mod, "model_fingerprint", recomputed)
    engine = make_engine(cfg, truncation="compact", keep_tokens=22)
    serve(engine, random_prompt(100, 5))
    again = serve(engine, random_prompt(100, 5))
    assert again.cached_tokens == 64 and cfg.fingerprint() == want
