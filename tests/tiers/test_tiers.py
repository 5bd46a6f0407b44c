"""Cache tiers across processes: kvstore blocks, peer snapshots, and their failures.

Module order matters: each test leaves the mesh as the next one expects
(A alive until the kill test; Redis and the kvstore restarted by their tests).
"""

from __future__ import annotations

import time

import torch

from kvmesh import cachekeys

BS = 128


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_for(fn, timeout=20.0, what="condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


BASE = prompt(700, 1)


def test_engine_b_resumes_from_engine_a_snapshot_exactly(tiers):
    """A computes a 400-token prompt (stores the window at 256, the last boundary at least
    KEEP = 134 before its end; writes its 3 blocks through).
    B, with an empty ledger, takes the blocks from the kvstore and the window from A."""
    tiers.generate("a", BASE[:400], max_tokens=1)
    wait_for(lambda: tiers.stats("a").get("kvstore_blocks_written", 0) >= 3, what="write-through")
    wait_for(lambda: tiers.stats("a").get("directory_published", 0) >= 1, what="publish")
    info = tiers.loop.run(tiers.engines["a"].model_info())
    assert info.block_size == BS
    keys = cachekeys.block_keys(BASE[:400], BS, info.model_fingerprint)
    assert tiers.loop.run(tiers.kvstore.lookup(keys)) == 3

    question = BASE[:256] + prompt(150, 2)        # cap 406 - 134 = 272 -> L1 = 256
    ids_a, _, last_a = tiers.generate("a", question, max_tokens=12)
    assert last_a.usage.cached_tokens == 256 and last_a.usage.replayed_tokens == 0
    ids_b, _, last_b = tiers.generate("b", question, max_tokens=12)
    assert last_b.usage.cached_tokens == 256 and last_b.usage.replayed_tokens == 0
    assert ids_b == ids_a
    stats = tiers.stats("b")
    assert stats["kvstore_block_hits"] >= 2 and stats["peer_snapshot_fetches"] == 1
    assert stats["snapshot_hits"] == 1


def test_redis_down_engines_replay_then_recover(tiers):
    tiers.valkey.stop()
    try:
        question = BASE[:256] + prompt(160, 3)
        ids, _, last = tiers.generate("b", question, max_tokens=4)
        assert len(ids) == 4
        # B has the blocks locally now but no snapshot at 256: it replays
        assert last.usage.cached_tokens == 256 and last.usage.replayed_tokens == BS
    finally:
        tiers.valkey.start()
    # after the restart Redis is empty: engines get a new lease and publish again
    key_holders = lambda: tiers.loop.run(tiers.directory.list_engines())  # noqa: E731
    wait_for(lambda: len(key_holders()) == 2, timeout=30, what="both engines re-registered")
    wait_for(lambda: sum(e.entries for e in key_holders()) >= 1, timeout=30,
             what="snapshots republished")
    question = BASE[:256] + prompt(170, 4)
    _, _, last = tiers.generate("b", question, max_tokens=2)
    assert last.usage.replayed_tokens == 0, "lookups work again: B fetched A's window"


def test_engine_a_killed_b_replays_within_deadline(tiers):
    tiers.procs["a"].kill()
    question = BASE[:256] + prompt(180, 5)
    t0 = time.monotonic()
    ids, _, last = tiers.generate("b", question, max_tokens=3)
    elapsed = time.monotonic() - t0
    assert len(ids) == 3 and last.usage.replayed_tokens == BS
    assert elapsed < 1.5 + 10.0, elapsed        # fetch deadline + replay on a loaded 2-core box
    assert tiers.stats("b")["peer_snapshot_failures"] >= 1
    tiers.start_engine("a", wait=True)


def test_kvstore_stopped_turns_hits_into_misses(tiers):
    tiers.procs["kvstore"].stop()
    fresh = prompt(500, 6)                      # nothing cached anywhere
    ids, _, last = tiers.generate("b", fresh, max_tokens=3)
    assert len(ids) == 3 and last.usage.cached_tokens == 0
    assert tiers.stats("b").get("kvstore_misses_on_error", 0) >= 1
