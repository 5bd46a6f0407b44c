"""--replay-blocks: blocks completed after a bounded replay, shared under the exact prefix
hash (share) or keyed under a lineage-salted hash that exact requests never match (isolate).

Small geometry (block 16, W 16, KEEP 22), policy `zero` so that every block hit replays:

    A  cold, 70 tokens        registers exact blocks 0..3 (L = 64)
    B  120 tokens             hits A's 4 blocks, replays [48, 64), computes 64.. : blocks 4..6
    C  the same 120 tokens    share: gets B's blocks 4, 5 too (cap 98 -> L1 = 96) and replays
                              again over replayed state; isolate: only A's exact blocks
                              (L1 = 64), the same replay as B, the same numbers as B
"""

import argparse

import pytest
import torch

from kvmesh import cachekeys
from services.engine.build import add_engine_args, engine_config
from services.engine.config import EngineConfig, small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()
KEEP = 22
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _run(engine, prompt, rid):
    seq = engine.add_request(prompt, ONE, request_id=rid)
    run_to_completion(engine)
    return seq, torch.stack(engine.logits[rid])


@pytest.mark.parametrize("mode", ["share", "isolate"])
def test_exact_requests_never_receive_isolated_blocks(mode):
    engine = make_engine(CFG, dtype="float64", truncation="compact", keep_tokens=KEEP,
                         swa_policy="zero", replay_blocks=mode, num_blocks=64)
    prompt = random_prompt(120, seed=5)
    a, _ = _run(engine, prompt[:70], "a")
    b, logits_b = _run(engine, prompt, "b")
    c, logits_c = _run(engine, prompt, "c")
    assert (a.cached_tokens, b.cached_tokens, b.replayed_tokens) == (0, 64, 16)

    exact = cachekeys.chain(prompt, 16, CFG.fingerprint())
    pool = engine.cache.pool
    assert all(pool.lookup(h) is not None for h in exact[:4])          # A's, exact
    if mode == "share":
        assert all(pool.lookup(h) is not None for h in exact[4:7])     # B's, under exact hashes
        assert c.cached_tokens == 96 and c.replayed_tokens == 16
        # a replay over replayed blocks: not what B (one replay) computed for the same prompt
        assert float((logits_c - logits_b).abs().max()) > 1e-6
        return
    assert all(pool.lookup(h) is None for h in exact[4:])
    lineage = "\x00replay@" + exact[3].hex()[:32]
    parent, isolated = exact[3], []
    for k in range(4, 7):
        parent = cachekeys.block_hash(parent, prompt[16 * k:16 * (k + 1)], CFG.fingerprint(), lineage)
        isolated.append(parent)
    assert all(pool.lookup(h) is not None for h in isolated)           # kept, under the lineage
    assert c.cached_tokens == 64 and c.replayed_tokens == 16
    assert torch.equal(logits_c, logits_b)                             # one replay, as B


def test_replay_blocks_flag_and_bad_values():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([]), env={}).replay_blocks == "share"
    assert engine_config(p.parse_args(["--replay-blocks", "isolate"]), env={}).replay_blocks == "isolate"
    with pytest.raises(ValueError, match="replay_blocks"):
        EngineConfig(replay_blocks="private")
