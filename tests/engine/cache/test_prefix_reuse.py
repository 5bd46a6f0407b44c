"""Prefix reuse: snapshot resume is exact, store positions follow the rules."""

import pytest
import torch

from services.engine.config import TINY, small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()          # W 16, block 16, B 6 -> KEEP >= 22
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def serve(engine, prompt, params=GREEDY):
    seq = engine.add_request(prompt, params)
    run_to_completion(engine)
    return seq


def logits(engine, seq):
    return torch.stack(engine.logits[seq.request_id])


@pytest.mark.parametrize("first_len", [95, 96, 97, 111, 112, 113])
@pytest.mark.parametrize("chunk", [1000, 7])
def test_resume_from_snapshot_equals_cold_run(first_len, chunk):
    base = random_prompt(200, 1)
    first = base[:first_len]
    store_at = (first_len - 1) // 16 * 16
    second = base[:store_at] + random_prompt(40, 2)       # shares exactly the stored prefix
    warm = make_engine(CFG, truncation="compact", keep_tokens=22, max_batched_tokens=chunk)
    serve(warm, first)
    assert warm.prefix.store.keys(), "prefill stored a snapshot"
    got = serve(warm, second)
    assert got.cached_tokens == store_at and got.replayed_tokens == 0
    assert warm.counters["snapshot_hits"] == 1
    cold = make_engine(CFG, truncation="compact", keep_tokens=22, max_batched_tokens=chunk)
    want = serve(cold, second)
    assert want.cached_tokens == 0
    assert got.output == want.output
    assert float((logits(warm, got) - logits(cold, want)).abs().max()) <= 1e-9


def test_resume_at_real_sizes():
    """Block 128, W 128, KEEP 134: a 300-token prompt stores at 256, a 400-token one resumes there."""
    base = random_prompt(400, 3)
    warm = make_engine(TINY, truncation="compact", keep_tokens=134, num_blocks=64)
    serve(warm, base[:300])
    got = serve(warm, base)
    assert got.cached_tokens == 256
    cold = make_engine(TINY, truncation="compact", keep_tokens=134, num_blocks=64)
    want = serve(cold, base)
    assert got.output == want.output
    assert float((logits(warm, got) - logits(cold, want)).abs().max()) <= 1e-9


def test_hits_are_capped_at_l_minus_keep():
    base = random_prompt(200, 4)
    engine = make_engine(CFG, truncation="compact", keep_tokens=40)
    serve(engine, base)                              # blocks of 0..199 cached
    again = serve(engine, base[:150])                # cap = 150 - 40 = 110 -> L1 = 96
    assert again.cached_tokens == 96


def test_no_reuse_with_truncation_off():
    base = random_prompt(200, 5)
    engine = make_engine(CFG)
    serve(engine, base)
    again = serve(engine, base)
    assert again.cached_tokens == 0 and engine.counters["snapshot_stores"] == 0


def test_salt_separates_tenants():
    base = random_prompt(120, 6)
    engine = make_engine(CFG, truncation="compact", keep_tokens=22)
    engine.add_request(base, GREEDY, salt="a")
    run_to_completion(engine)
    b = engine.add_request(base, GREEDY, salt="b")
    run_to_completion(engine)
    assert b.cached_tokens == 0


# L -> prefill store position (block 128), or None
STORE_TABLE = [(127, None), (128, None), (129, 128), (255, 128), (256, 128), (257, 256),
               (1000, 896)]


@pytest.mark.parametrize("length,expected", STORE_TABLE)
@pytest.mark.parametrize("chunk", [4096, 100])
def test_prefill_store_positions(length, expected, chunk):
    engine = make_engine(TINY, truncation="compact", keep_tokens=134, num_blocks=64,
                         max_batched_tokens=chunk)
    seq = engine.add_request(random_prompt(length, length), SamplingParams(temperature=0, max_tokens=1))
    stored_during_prefill = []
    while engine.has_work:
        engine.step()
        if not seq.finished and seq.prefilling:
            stored_during_prefill.append(len(engine.prefix.store))
    assert set(stored_during_prefill) <= {0}, "stored only after the last chunk"
    positions = sorted(s.position for s in (s for _, s in engine.prefix.store.items()))
    assert positions == ([] if expected is None else [expected])


@pytest.mark.parametrize("policy,expected", [("full", [16, 32, 48, 64]), ("periodic:2", [32, 64]),
                                             ("zero", [])])
def test_decode_crossings_and_policies(policy, expected):
    """A 10-token prompt decoding 60 tokens crosses 16, 32, 48; the replica keeps the latest
    and the request end stores it. Every crossing's copy is checked against the ring."""
    engine = make_engine(CFG, truncation="compact", keep_tokens=22, swa_policy=policy)
    copies = []
    original = engine.prefix._copy_from_ring

    def spy(seq, b):
        original(seq, b)
        copies.append((b, seq.num_computed))

    engine.prefix._copy_from_ring = spy
    seq = engine.add_request(random_prompt(10, 7), SamplingParams(temperature=0, max_tokens=60,
                                                                  ignore_eos=True))
    run_to_completion(engine)
    assert [b for b, _ in copies] == [b for b in expected if b < 69]
    assert all(nc == b for b, nc in copies)     # one-token steps: copied with lag 0
    stored = sorted(s.position for s in (s for _, s in engine.prefix.store.items()))
    assert stored == ([] if not copies else [copies[-1][0]])
    assert len(seq.tokens) == 70


@pytest.mark.parametrize("length,chunk", [(100, 1000), (100, 7), (131, 40)])
def test_extra_state_ring_reassembles_the_same_snapshot(length, chunk):
    """A prefill engine with the long (kvstore) ring re-assembles the window at the store
    position from the ring after the last chunk; it must equal the window captured in flight."""
    # the ring is sized by the config alone (no KVMESH_* variable is read by make_engine)
    prompt = random_prompt(length, 8)
    snaps = []
    for extra in (False, True):
        engine = make_engine(CFG, truncation="compact", keep_tokens=22, extra_state=extra,
                             max_batched_tokens=chunk)
        assert engine.cache.states.ring == (22 + 128 + 22 if extra else 22)
        serve(engine, prompt, SamplingParams(temperature=0, max_tokens=1))
        (snap,) = (s for _, s in engine.prefix.store.items())
        snaps.append(snap)
    assert snaps[0].position == snaps[1].position == (length - 1) // 16 * 16
    assert len(snaps[0].data) == engine.cache.states.block.state_size_to_disk == 4 * 22 * 528
    assert snaps[0].data == snaps[1].data


def test_prefetched_blocks_install_and_a_bad_payload_is_a_miss():
    """Blocks fetched from the kvstore before admission fill an empty ledger; a payload of
    the wrong size stops the run there (a miss), never an error."""
    from kvmesh import cachekeys as hashing
    from services.engine.cache.prefetch import Prefetched

    base = random_prompt(200, 21)
    donor = make_engine(CFG, truncation="compact", keep_tokens=22)
    serve(donor, base)
    hashes = hashing.chain(base, 16, CFG.fingerprint())
    payloads = {h: donor.cache.store.serialize(donor.cache.pool.lookup(h)) for h in hashes[:8]}

    fresh = make_engine(CFG, truncation="compact", keep_tokens=22)
    seq = fresh.add_request(base[:150], GREEDY, prefetched=Prefetched(blocks=payloads))
    run_to_completion(fresh)
    assert seq.cached_tokens == 128 and seq.replayed_tokens == 16   # 8 blocks, no window
    cold = make_engine(CFG, truncation="compact", keep_tokens=22, swa_policy="zero")
    serve(cold, base)                       # same blocks, then replay: same numbers expected
    again = serve(cold, base[:150])
    assert again.output == seq.output

    bad = dict(payloads)
    bad[hashes[3]] = payloads[hashes[3]][:-4]
    other = make_engine(CFG, truncation="compact", keep_tokens=22)
    seq = other.add_request(base[:150], GREEDY, prefetched=Prefetched(blocks=bad))
    run_to_completion(other)
    assert seq.cached_tokens == 48 and other.counters["remote_blocks_refused"] == 1
