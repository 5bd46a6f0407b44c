"""Rollback of up to B = 6 computed tokens equals never having appended them."""

import pytest
import torch

from services.engine.cache.layout import RuntimeLayout
from services.engine.cache.manager import CacheManager
from services.engine.config import EngineConfig, small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.core.sequence import Sequence
from services.engine.model import reference
from services.engine.model import weights as weights_mod
from services.engine.model.runner import ModelRunner, Work
from tests.engine.helpers import random_prompt

CFG = small_test_config()       # W 16, CSA m 4, HCA m 16, block 16
W = weights_mod.init_weights(CFG, 0, torch.float64)


def setup(num_blocks=64):
    cache = CacheManager(RuntimeLayout.build(CFG, EngineConfig(num_slots=2, num_blocks=num_blocks)))
    return cache, ModelRunner(CFG, W, cache.states, cache.store)


def feed(cache, runner, seq, tokens):
    """Append tokens one decode step at a time; return the logits of each step."""
    out = []
    for t in tokens:
        seq.output.append(t)
        end = seq.num_computed + 1
        assert cache.grow(seq, end)
        res = runner.forward([Work(seq.slot, seq.table, seq.tokens, seq.num_computed, end)])
        cache.commit(seq, end)
        out.append(res.logits[0])
    return out


def new_seq(cache, runner, prompt):
    seq = Sequence("s", list(prompt), SamplingParams(), seed=0)
    cache.admit(seq)
    assert cache.grow(seq, len(prompt))
    runner.forward([Work(seq.slot, seq.table, seq.tokens, 0, len(prompt), want_logits=False)])
    cache.commit(seq, len(prompt))
    return seq


# prompt lengths chosen so the rolled-back span crosses a CSA group (m 4), an HCA group and a
# block boundary (16), or sits inside a group
@pytest.mark.parametrize("prompt_len,r", [(45, 1), (45, 3), (46, 6), (47, 2), (50, 4), (61, 6)])
def test_rollback_equals_never_appending(prompt_len, r):
    prompt = random_prompt(prompt_len, prompt_len)
    cont = random_prompt(10, 1000 + r)
    spec = random_prompt(r, 2000 + r)
    cache, runner = setup()
    seq = new_seq(cache, runner, prompt)
    feed(cache, runner, seq, spec)
    hashes_before = len(seq.hashes)
    cache.rollback(seq, r, max_backtrack=6)
    assert seq.num_computed == prompt_len and seq.tokens == prompt
    assert len(seq.hashes) == prompt_len // CFG.block_size <= hashes_before
    got = torch.stack(feed(cache, runner, seq, cont))
    ref = reference.forward(W, CFG, prompt + cont).logits[prompt_len:]
    assert float((got - ref).abs().max()) <= 1e-9
    cache.check_integrity([seq])


def test_rollback_of_a_shared_block_copies_it():
    """The rolled-back sequence must not disturb another holder of a registered block."""
    prompt = random_prompt(46, 5)
    cache, runner = setup()
    seq = new_seq(cache, runner, prompt)
    feed(cache, runner, seq, random_prompt(4, 6))             # completes block 2 (tokens 32..47)
    shared = seq.table[2]
    assert cache.pool.hash_of[shared] is not None
    before = cache.store.serialize(shared)
    cache.pool.acquire(shared)                                # another sequence holds it
    cache.rollback(seq, 4, max_backtrack=6)
    assert seq.table[2] != shared and cache.pool.ref_cnt[shared] == 1
    assert cache.store.serialize(shared) == before
    assert cache.pool.hash_of[shared] is not None             # still shareable by its hash
    feed(cache, runner, seq, random_prompt(4, 7))
    assert cache.store.serialize(shared) == before


def test_rollback_beyond_b_is_refused():
    cache, runner = setup()
    seq = new_seq(cache, runner, random_prompt(30, 1))
    with pytest.raises(ValueError, match="rollback of 7 tokens"):
        cache.rollback(seq, 7, max_backtrack=6)
