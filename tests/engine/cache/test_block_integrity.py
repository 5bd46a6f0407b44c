"""A block fetched from the kvstore is installed only if its size, header, layout and
embedded digest all check out; anything else is a miss (never installed, never an error)."""

import numpy as np
import pytest
import torch
from blake3 import blake3

from kvmesh import cachekeys as hashing
from services.engine.cache.block_store import OVERHEAD, BlockStore
from services.engine.cache.prefetch import Prefetched
from services.engine.config import small_test_config
from services.engine.core.sampling import SamplingParams
from tests.engine.helpers import make_engine, random_prompt, run_to_completion

CFG = small_test_config()
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def filled_store(seed: int = 0) -> BlockStore:
    store = BlockStore(CFG, 4)
    gen = torch.Generator().manual_seed(seed)
    for t in [*store.entries.values(), *store.index_keys.values()]:
        t.copy_(torch.randn(t.shape, generator=gen))
    return store


def flip(blob: bytes, pos: int) -> bytes:
    bad = bytearray(blob)
    bad[pos] ^= 0x01
    return bytes(bad)


def test_layout_is_header_raw_rows_and_blake3_of_both():
    store = filled_store()
    blob = store.serialize(2)
    rows = b"".join(
        np.ascontiguousarray(t[2].numpy()).tobytes()
        for layer in CFG.compressed_layers
        for t in [store.entries[layer], *([store.index_keys[layer]] if layer in store.index_keys else [])]
    )
    assert len(blob) == 16 + len(rows) + 32 == store.bytes_per_block() == len(rows) + OVERHEAD
    assert blob[:5] == b"KVBK\x01" and int.from_bytes(blob[12:16], "little") == len(rows)
    assert blob[16:-32] == rows
    assert blob[-32:] == blake3(blob[:-32]).digest()


def test_round_trip_into_another_block():
    store = filled_store()
    store.deserialize(0, store.serialize(3))
    assert store.serialize(0) == store.serialize(3)


@pytest.mark.parametrize("where", ["header", "layout", "rows", "digest"])
def test_damaged_block_refused_and_nothing_written(where):
    store = filled_store()
    blob = store.serialize(1)
    pos = {"header": 0, "layout": 9, "rows": len(blob) // 2, "digest": len(blob) - 1}[where]
    before = store.serialize(0)
    with pytest.raises(ValueError):
        store.deserialize(0, flip(blob, pos))
    with pytest.raises(ValueError):
        store.deserialize(0, blob[:-1])
    assert store.serialize(0) == before


def test_block_of_another_layout_refused_even_with_a_valid_digest():
    other = BlockStore(CFG, 2, dtype=torch.float64)
    store = filled_store()
    blob = store.serialize(1)
    forged = bytearray(blob)
    forged[8:12] = other.layout_fp().to_bytes(4, "little")
    forged[-32:] = blake3(bytes(forged[:-32])).digest()
    with pytest.raises(ValueError, match="layout"):
        store.deserialize(0, bytes(forged))


def test_engine_never_installs_a_block_with_a_wrong_digest():
    """Prefetched blocks 0..7 with block 3's rows damaged (same size): blocks 0..2 are
    installed, block 3 is refused and counted, and the run generates exactly what an
    engine given only blocks 0..2 does (the damaged block had no effect at all)."""
    base = random_prompt(200, 21)
    donor = make_engine(CFG, truncation="compact", keep_tokens=22)
    seq = donor.add_request(base, GREEDY)
    run_to_completion(donor)
    hashes = hashing.chain(base, 16, CFG.fingerprint())
    payloads = {h: donor.cache.store.serialize(donor.cache.pool.lookup(h)) for h in hashes[:8]}
    bad = dict(payloads)
    bad[hashes[3]] = flip(payloads[hashes[3]], 16 + 5)  # one bit of the rows
    engine = make_engine(CFG, truncation="compact", keep_tokens=22)
    seq = engine.add_request(base[:150], GREEDY, prefetched=Prefetched(blocks=bad))
    run_to_completion(engine)
    assert seq.cached_tokens == 48 and engine.counters["remote_blocks_refused"] == 1
    own = engine.cache.pool.lookup(hashes[3])  # computed by prefill, not the damaged bytes
    assert own is None or engine.cache.store.serialize(own)[16:-32] != bad[hashes[3]][16:-32]
    ref = make_engine(CFG, truncation="compact", keep_tokens=22)
    want = ref.add_request(base[:150], GREEDY,
                           prefetched=Prefetched(blocks={h: payloads[h] for h in hashes[:3]}))
    run_to_completion(ref)
    assert want.cached_tokens == 48 and ref.counters["remote_blocks_refused"] == 0
    assert seq.output == want.output
