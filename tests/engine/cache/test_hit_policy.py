"""Hit policy: the deepest snapshot in [L1 - W, L1] is restored and [S, L1) recomputed
exactly; only without one does the request fall back to the approximate bounded replay.

Small geometry (block = W = 16, KEEP 22) scales the design's 128-token numbers down;
one case runs at the real sizes (block = W = 128, KEEP 134)."""

import pytest
import torch

from services.engine.config import TINY, small_test_config
from services.engine.core.sampling import SamplingParams
from services.engine.model import reference
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()
KEEP = 22
ONE = SamplingParams(temperature=0.0, max_tokens=1)
DECODE = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def engine(policy, chunk=1000, cfg=CFG, keep=KEEP, **kw):
    return make_engine(cfg, truncation="compact", keep_tokens=keep, swa_policy=policy,
                       max_batched_tokens=chunk, **kw)


def serve(e, prompt, params=DECODE):
    seq = e.add_request(prompt, params)
    run_to_completion(e)
    return seq


def stored(e):
    return sorted(s.position for _, s in e.prefix.store.items())


def logits(e, seq):
    return torch.stack(e.logits[seq.request_id])


def check_exact(warm, got, cold, want, cfg, keep):
    """Same tokens as the cold run; logits equal to it and to the independent reference."""
    assert want.cached_tokens == 0
    assert got.output == want.output
    assert float((logits(warm, got) - logits(cold, want)).abs().max()) <= 1e-9
    tokens = got.prompt + got.output[:-1]
    ref = reference.forward(warm.weights, cfg, tokens, dec_lo=len(got.prompt) - keep).logits
    assert float((logits(warm, got) - ref[-len(got.output):]).abs().max()) <= 1e-9


# (policy, first prompt length, L1): the first prompt caches blocks [0, L1) and its prefill
# stores one snapshot, at L1 - 16 (one block, = W, before the end of the run)
CASES = [("periodic:2", 90, 80, 1000), ("periodic:2", 90, 80, 7), ("periodic:3", 70, 64, 1000),
         ("periodic:4", 90, 80, 1000)]


@pytest.mark.parametrize("policy,first_len,l1,chunk", CASES)
def test_snapshot_one_block_back_resumes_exactly(policy, first_len, l1, chunk):
    base = random_prompt(200, 31)
    second = base[:l1] + random_prompt(40, 32)        # the block run ends exactly at L1
    warm = engine(policy, chunk)
    serve(warm, base[:first_len], ONE)
    assert stored(warm) == [l1 - 16]
    got = serve(warm, second)
    assert (got.cached_tokens, got.recomputed_tokens, got.replayed_tokens) == (l1, 16, 0)
    c = warm.counters
    assert (c["snapshot_hits"], c["snapshot_misses"]) == (1, 0)
    assert (c["recomputed_tokens"], c["replayed_tokens"]) == (16, 0)
    cold = engine(policy, chunk)
    check_exact(warm, got, cold, serve(cold, second), CFG, KEEP)


def test_without_that_snapshot_the_same_hit_is_the_approximate_replay():
    """The situation the policy fixes: same blocks, no snapshot (zero policy) -> replay,
    whose logits are measurably off; so the exact resume above is not a coincidence."""
    base = random_prompt(200, 31)
    second = base[:80] + random_prompt(40, 32)
    warm = engine("zero")
    serve(warm, base[:90], ONE)
    got = serve(warm, second)
    assert (got.cached_tokens, got.recomputed_tokens, got.replayed_tokens) == (80, 0, 16)
    cold = engine("zero")
    want = serve(cold, second)
    assert float((logits(warm, got) - logits(cold, want)).abs().max()) > 1e-6


def test_a_snapshot_further_back_than_w_is_not_used():
    """periodic:3 stores at 48; a run ending at 80 is 32 > W tokens past it: replay."""
    base = random_prompt(200, 33)
    warm = engine("periodic:3")
    serve(warm, base[:90], ONE)
    assert stored(warm) == [48]
    got = serve(warm, base[:80] + random_prompt(40, 34))
    assert (got.cached_tokens, got.recomputed_tokens, got.replayed_tokens) == (80, 0, 16)
    assert (warm.counters["snapshot_hits"], warm.counters["snapshot_misses"]) == (0, 1)


def test_the_deepest_snapshot_wins():
    """Snapshots at L1 - 16 and at L1: resume at L1, nothing recomputed."""
    base = random_prompt(200, 35)
    warm = engine("full")
    serve(warm, base[:70], ONE)                       # stores 64
    serve(warm, base[:90], ONE)                       # hits 64, stores 80
    assert stored(warm) == [64, 80]
    got = serve(warm, base[:80] + random_prompt(40, 36))
    assert (got.cached_tokens, got.recomputed_tokens, got.replayed_tokens) == (80, 0, 0)


def test_a_foreign_snapshot_is_skipped_for_the_next_one():
    """A peer's snapshot at L1 with a wrong size is refused; the local one at L1 - 16 is used."""
    from kvmesh import cachekeys as hashing
    from services.engine.cache.prefetch import Prefetched
    from services.engine.cache.snapshots import Snapshot

    base = random_prompt(200, 31)
    second = base[:80] + random_prompt(40, 32)
    warm = engine("periodic:2")
    serve(warm, base[:90], ONE)                       # blocks [0, 80), snapshot at 64
    key = warm.prefix.key_at(hashing.chain(second[:80], 16, CFG.fingerprint()), 80)
    bad = Snapshot(key, 80, warm.prefix.layout_fp, CFG.fingerprint(), b"\0" * 10, 0.0)
    got = warm.add_request(second, DECODE, prefetched=Prefetched(snapshots={key: bad}))
    run_to_completion(warm)
    assert (got.cached_tokens, got.recomputed_tokens) == (80, 16)
    assert warm.counters["snapshot_refused"] == 1 and warm.counters["snapshot_hits"] == 1


def test_real_geometry_snapshot_128_back():
    """Block 128, W 128, KEEP 134, periodic:2: a 400-token prompt caches [0, 384) and stores
    at 256; a prompt sharing 384 tokens restores 256 and recomputes 128 tokens exactly."""
    base = random_prompt(600, 37)
    second = base[:384] + random_prompt(150, 38)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    warm = engine("periodic:2", cfg=TINY, keep=134, num_blocks=64, chunk=512)
    serve(warm, base[:400], ONE)
    assert stored(warm) == [256]
    got = serve(warm, second, params)
    assert (got.cached_tokens, got.recomputed_tokens, got.replayed_tokens) == (384, 128, 0)
    assert warm.counters["snapshot_hits"] == 1 and warm.counters["recomputed_tokens"] == 128
    cold = engine("periodic:2", cfg=TINY, keep=134, num_blocks=64, chunk=512)
    check_exact(warm, got, cold, serve(cold, second, params), TINY, 134)
