"""A request hashes each of its blocks once (admission, commits and a prefetch share one
chain); the model fingerprint is computed once per engine, not per admission."""

from __future__ import annotations

import json

import pytest

from kvmesh import cachekeys
from kvmesh.services.engine.cache.prefetch import Prefetched
from kvmesh.services.engine.core.sampling import SamplingParams
from tests.engine.engines import random_prompt, run_to_completion, serve_core

BS = 128
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
    req = engine.add_request(prompt, PARAMS, prefetched=prefetched)
    run_to_completion(engine)
    return req


def test_cold_request_hashes_each_block_once(hashed):
    engine = serve_core()
    prompt = random_prompt(400, 3)
    req = serve(engine, prompt)
    tokens = req.prompt + req.output
    # 400 + 20 tokens, the last sampled one never computed: 419 // 128 = 3 complete blocks,
    # each hashed exactly once between admission and the decode steps' commits
    assert len(req.output) == 20
    assert hashed == blocks_of(tokens, 3)
    assert req.chain[:3] == cachekeys.chain(tokens[:3 * BS], BS, engine.cfg.fingerprint())


def test_warm_request_and_prefetch_reuse_the_chain(hashed):
    engine = serve_core()
    serve(engine, random_prompt(400, 3))
    hashed.clear()
    prompt = random_prompt(400, 3)[:256] + random_prompt(144, 4)
    view = engine.local_view(prompt, "")                        # what a prefetch computes
    assert view.n_local == 2 and hashed == blocks_of(prompt, 3)
    req = serve(engine, prompt, Prefetched(hashes=view.hashes))
    assert req.cached_tokens == 256
    assert hashed == blocks_of(prompt, 3)                       # nothing hashed twice


def test_fingerprint_is_computed_once_per_engine(monkeypatch):
    engine = serve_core()
    want = cachekeys.model_fingerprint(json.loads(engine.cfg.to_json()))  # what a gateway computes

    def recomputed(fields):
        raise AssertionError("model fingerprint recomputed after construction")

    monkeypatch.setattr(cachekeys, "model_fingerprint", recomputed)
    serve(engine, random_prompt(300, 5))
    again = serve(engine, random_prompt(300, 5))
    assert again.cached_tokens == 256 and engine.cfg.fingerprint() == want
