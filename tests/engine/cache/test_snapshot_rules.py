"""Snapshot rules: start-up refusals, prefill store positions under periodic:N, decode
replica copies with a lag, and the replica rule for preempted, aborted and rolled-back
requests (prefix.py: a slot's latest completed replica is stored when the slot goes back,
whatever the reason; a rollback below it drops it)."""

import pytest
import torch

from kvmesh import cachekeys as hashing
from services.engine.config import EngineConfig, small_test_config
from services.engine.core.engine import EngineCore
from services.engine.core.sampling import SamplingParams
from services.engine.model.runner import Work
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()          # block = W = 16, B 6: inference ring 22
KEEP = 22


def stored(e):
    return sorted(s.position for _, s in e.prefix.store.items())


# --- start-up refusals -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_truncation_without_keep_is_refused(mode):
    with pytest.raises(ValueError, match="needs KEEP given explicitly"):
        EngineCore(CFG, EngineConfig(truncation=mode))
    with pytest.raises(ValueError, match="smaller than W \\+ B = 22"):
        EngineCore(CFG, EngineConfig(truncation=mode, keep_tokens=KEEP - 1))
    EngineCore(CFG, EngineConfig(truncation=mode, keep_tokens=KEEP))        # the minimum is fine


@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_deterministic_mode_refuses_truncation(mode):
    with pytest.raises(ValueError, match="deterministic mode refuses YOCO truncation"):
        EngineConfig(deterministic=True, truncation=mode, keep_tokens=KEEP)
    assert EngineConfig(deterministic=True, truncation="off").deterministic


# --- prefill stores under periodic:N --------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("length", [16, 17, 32, 33, 47, 49, 96, 97, 100])
def test_prefill_stores_at_multiples_of_n_blocks(n, length):
    step = 16 * n
    want = (length - 1) // step * step
    e = make_engine(CFG, truncation="compact", keep_tokens=KEEP, swa_policy=f"periodic:{n}",
                    max_batched_tokens=7)
    seq = e.add_request(random_prompt(length, length), SamplingParams(temperature=0, max_tokens=1))
    run_to_completion(e)
    assert stored(e) == ([want] if want >= 16 else [])
    if want:
        key = e.prefix.key_at(hashing.chain(seq.prompt, 16, CFG.fingerprint()), want)
        assert e.prefix.store.get(key).position == want


# --- decode copies at a boundary reached with a lag (a verify step of 1 + k rows) ----------
def verify_step(e, seq, drafts):
    """Compute the sampled token and k draft tokens in one forward, as speculative
    decoding's verify step does: positions [num_computed, num_computed + 1 + k)."""
    for t in drafts:
        e.cache.append_token(seq, t)
    start, end = seq.num_computed, seq.num_computed + 1 + len(drafts)
    assert e.cache.grow(seq, end)
    work = Work(seq.slot, seq.table, seq.tokens, start, end, enc_lo=seq.enc_lo,
                dec_lo=seq.dec_lo, cmp_from=seq.cmp_from)
    res = e.runner.forward([work])
    e.cache.commit(seq, end)
    e.prefix.after_forward(seq, work, res, 0)


def window_rows(e, slot, b):
    """The encoder rings' rows of positions [b - W, b): what a snapshot at b must hold."""
    pos = torch.arange(b - CFG.window, b)
    return [e.cache.states.swa[layer][slot, pos.remainder(e.cache.states.ring)].clone()
            for layer in range(CFG.n_encoder_layers)]


@pytest.mark.parametrize("lag", [1, 2, 3, 4, 5, 6])
def test_decode_copy_when_l_is_a_multiple_of_the_block(lag):
    """Prompt L = 32: prefill stores at 16; the first step past 32 ends `lag` tokens
    beyond it. lag 1..6 (B) copy the window at 32 intact (the rows overwritten since are
    spare rows): lag 6 is a verify step whose 6 drafts were all accepted across the
    boundary (before, lag 6 copied nothing and the snapshot at 32 never existed). Ending
    the request stores it."""
    e = make_engine(CFG, truncation="compact", keep_tokens=KEEP)
    seq = e.add_request(random_prompt(32, 51), SamplingParams(temperature=0, max_tokens=50,
                                                              ignore_eos=True))
    e.step()                                       # prefill [0, 32), first token sampled
    assert seq.num_computed == 32 and stored(e) == [16]
    want = window_rows(e, seq.slot, 32)
    verify_step(e, seq, random_prompt(lag - 1, 52))
    assert seq.num_computed == 32 + lag
    assert e.prefix.replica_pos[seq.slot] == 32
    r = e.prefix.r_inf
    rows = torch.arange(32 - CFG.window, 32).remainder(r)
    for layer in range(CFG.n_encoder_layers):
        assert torch.equal(e.prefix.replica[seq.slot, layer, rows], want[layer])
    e.abort(seq.request_id)                        # aborted: the replica is stored too
    assert stored(e) == [16, 32]
    e.check_integrity()


@pytest.mark.parametrize("back,kept", [(0, True), (1, False)])
def test_rollback_below_the_replica_drops_it(back, kept):
    """Rolling back to exactly the boundary keeps the copy (its window is intact); one token
    further takes back a token the copy saw: it is dropped and never stored."""
    e = make_engine(CFG, truncation="compact", keep_tokens=KEEP)
    seq = e.add_request(random_prompt(32, 53), SamplingParams(temperature=0, max_tokens=50,
                                                              ignore_eos=True))
    e.step()
    verify_step(e, seq, random_prompt(3, 54))      # computed up to 36, copy at 32
    e.rollback(seq.request_id, 4 + back)
    assert seq.num_computed == 32 - back
    assert (e.prefix.replica_pos[seq.slot] == 32) is kept
    e.abort(seq.request_id)
    assert stored(e) == ([16, 32] if kept else [16])


# --- preemption with truncation on ----------------------------------------------------------
def test_preemption_with_truncation_keeps_the_ledgers_whole():
    """Six requests in a pool too small for them, truncation on: every step the block
    refcounts match the tables and slots balance; all finish with their full length and
    leave nothing held."""
    e = make_engine(CFG, truncation="compact", keep_tokens=KEEP, num_slots=4, num_blocks=20,
                    max_batched_tokens=48)
    seqs = [e.add_request(random_prompt(n, n), SamplingParams(temperature=0, max_tokens=30,
                                                              ignore_eos=True))
            for n in (60, 130, 45, 200, 95, 150)]
    run_to_completion(e, check=True)
    assert sum(s.preemptions for s in seqs) > 0
    assert all(len(s.output) == 30 and s.finish.value == "length" for s in seqs)
    stats = e.stats()
    assert stats["blocks_in_use"] == 0 and stats["slots_in_use"] == 0
    e.cache.pool.check_integrity()


def test_a_preempted_request_stores_its_replica():
    """Two decoders in 6 blocks copy their windows at 32, then at 48; at 49 the older one
    needs a fourth block, the newer one is preempted, and its unstored copy at 48 goes to
    the store before its slot is freed."""
    e = make_engine(CFG, truncation="compact", keep_tokens=KEEP, num_slots=2, num_blocks=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = e.add_request(random_prompt(20, 61), params)
    b = e.add_request(random_prompt(20, 62), params)
    while b.preemptions == 0:
        e.step()
        e.check_integrity()
    assert b.slot is None and a.num_computed == 49      # a got its block, computed 48
    held = {k: s.position for k, s in e.prefix.store.items()}
    key = e.prefix.key_at(hashing.chain(b.tokens[:48], 16, CFG.fingerprint()), 48)
    assert held.get(key) == 48
    assert sorted(held.values()) == [16, 16, 48]     # the two prefill snapshots and b's copy
    run_to_completion(e)
    assert len(a.output) == len(b.output) == 40


class Exact:
    """Drafts the reference continuation itself: every draft is accepted."""

    def __init__(self, reference: list[int]):
        self.reference = reference

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return self.reference[len(tokens) : len(tokens) + k]


def test_all_six_drafts_accepted_across_a_boundary_leave_its_snapshot():
    """End to end: prompt 33, greedy, ngram:6 with drafts that are all accepted, so verify
    steps compute [33, 40), [40, 47), [47, 54): the last ends 6 past the boundary at 48.
    The snapshot at 48 exists and is byte-equal to the one a run without speculation
    (lag 1) stores."""
    prompt = random_prompt(33, 61)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    kw = dict(truncation="compact", keep_tokens=KEEP, num_slots=1)
    off = make_engine(CFG, **kw)
    ref = off.add_request(prompt, params)
    run_to_completion(off)
    spec = make_engine(CFG, weights=off.weights, speculative="ngram:6", **kw)
    spec.spec.drafter = Exact(prompt + ref.output)
    seq = spec.add_request(prompt, params)
    ends = []
    while spec.has_work:
        spec.step()
        ends.append(seq.num_computed)
    assert seq.output == ref.output
    assert 54 in ends and 48 not in ends           # the boundary was crossed at lag 6
    assert stored(spec) == stored(off) == [32, 48]
    for position in (32, 48):
        want = [s for _, s in off.prefix.store.items() if s.position == position][0]
        got = [s for _, s in spec.prefix.store.items() if s.position == position][0]
        assert got.data == want.data, position
