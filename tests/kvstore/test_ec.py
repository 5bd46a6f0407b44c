"""The shard codec, named after the failures it must survive (pure, no I/O)."""

import os
import random

import pytest

from kvmesh.services.kvstore import ec

L = ec.Layout()
KEY = "ab" * 32


def shards_of(data: bytes, gen: int = 7) -> list[bytes]:
    return ec.encode(L, KEY, gen, data)


@pytest.mark.parametrize("size", [0, 1, 9, 10, 11, 1001, 4096 * 3 + 7, 3 * 1024 * 1024 + 1])
def test_round_trip_all_sizes(size):
    data = os.urandom(size)
    out = ec.decode(L, KEY, dict(enumerate(shards_of(data))))
    assert out.data == data and out.missing == frozenset()


@pytest.mark.parametrize("lost", [(0, 1), (10, 11), (3, 11), (9,), ()])
def test_rebuild_after_loss_of_up_to_two(lost):
    data = os.urandom(50_001)
    blobs = {i: (None if i in lost else s) for i, s in enumerate(shards_of(data))}
    out = ec.decode(L, KEY, blobs)
    assert out.data == data
    assert out.missing == frozenset(lost)
    fresh = ec.rebuild(L, KEY, out, sorted(lost))
    assert all(fresh[i] == shards_of(data)[i] for i in lost)


def test_three_lost_is_unreadable():
    blobs = dict(enumerate(shards_of(b"x" * 1000)))
    for i in (0, 5, 11):
        blobs[i] = None
    with pytest.raises(ec.NotEnoughShards):
        ec.decode(L, KEY, blobs)


def test_bitrot_detected_anywhere_in_shard():
    shard = shards_of(os.urandom(5000))[4]
    for pos in [0, 8, 20, 40, len(shard) // 2, len(shard) - 1]:
        bad = bytearray(shard)
        bad[pos] ^= 0x01
        with pytest.raises(ec.ShardError):
            ec.parse(L, bytes(bad), key=KEY, index=4)


def test_bitrot_counts_as_loss_and_decode_still_exact():
    data = os.urandom(77_777)
    blobs = dict(enumerate(shards_of(data)))
    for i in (2, 7):
        b = bytearray(blobs[i])
        b[-100] ^= 0xFF
        blobs[i] = bytes(b)
    out = ec.decode(L, KEY, blobs)
    assert out.data == data and out.missing == {2, 7}


def test_truncated_shard_rejected():
    shard = shards_of(b"hello world")[0]
    with pytest.raises(ec.ShardError):
        ec.parse(L, shard[:-1], key=KEY, index=0)
    with pytest.raises(ec.ShardError):
        ec.parse(L, shard[:10])


def test_misplaced_shard_rejected():
    shards = shards_of(b"hello world")
    with pytest.raises(ec.ShardError):
        ec.parse(L, shards[1], key=KEY, index=2)
    with pytest.raises(ec.ShardError):
        ec.parse(L, shards[1], key="cd" * 32, index=1)


def test_foreign_layout_rejected():
    other = ec.Layout(k=8, m=4)
    with pytest.raises(ec.ShardError):
        ec.parse(L, ec.encode(other, KEY, 1, b"abc")[0])


def test_mixed_generations_never_blend():
    """An overwrite racing a read: 6 shards of gen 1 and 6 of gen 2 is unreadable,
    never a mix of the two objects."""
    old, new = os.urandom(3000), os.urandom(3000)
    a, b = shards_of(old, gen=1), shards_of(new, gen=2)
    blobs = {i: (a[i] if i < 6 else b[i]) for i in range(12)}
    with pytest.raises(ec.NotEnoughShards):
        ec.decode(L, KEY, blobs)
    blobs = {i: (a[i] if i < 11 else b[i]) for i in range(12)}
    out = ec.decode(L, KEY, blobs)
    assert out.data == old and out.missing == {11}
    with pytest.raises(ec.NotEnoughShards):
        ec.decode(L, KEY, blobs, generation=2)


def test_header_fields_round_trip():
    shard = ec.encode(L, KEY, 123456789, b"z" * 95)[11]
    head, payload = ec.parse(L, shard, key=KEY, index=11)
    assert (head.index, head.generation, head.object_size, head.key) == (11, 123456789, 95, KEY)
    assert head.fragment_size == len(payload)
    assert len(shard) == L.shard_bytes(95, KEY)


def test_checksum_is_zlib_crc32_of_everything_before_it():
    """The trailer is zlib's crc32 (computed by ISA-L): shards written by any build stay
    readable, and a shard whose trailer is recomputed with zlib itself still parses."""
    import struct
    import zlib

    for shard in ec.encode(L, KEY, 5, os.urandom(5000)):
        (crc,) = struct.unpack_from("<I", shard, len(shard) - 4)
        assert crc == zlib.crc32(shard[:-4])
    shard = bytearray(ec.encode(L, KEY, 5, b"q" * 300)[3])
    shard[ec.HEADER_SIZE + len(KEY)] ^= 1  # payload byte flipped, trailer rewritten by zlib
    struct.pack_into("<I", shard, len(shard) - 4, zlib.crc32(bytes(shard[:-4])))
    head, _ = ec.parse(L, bytes(shard), key=KEY, index=3)
    assert head.index == 3


def test_random_loss_patterns_table():
    rng = random.Random(0)
    data = os.urandom(12345)
    shards = shards_of(data)
    for _ in range(30):
        lost = set(rng.sample(range(12), rng.randint(0, 2)))
        out = ec.decode(L, KEY, {i: s for i, s in enumerate(shards) if i not in lost})
        assert out.data == data


@pytest.mark.parametrize("size", [0, 1, 9, 10, 11, 4096 * 3 + 7, 4 * 1024 * 1024 + 7])
def test_all_data_shards_fast_path_matches_pyeclib(size):
    """With shards 0..k-1 healthy decode concatenates them; same bytes as pyeclib."""
    data = os.urandom(size)
    shards = shards_of(data)
    payloads = [ec.parse(L, s, key=KEY, index=i)[1] for i, s in enumerate(shards)]
    fast = ec._concat_data(L, payloads[: L.k], size)
    assert fast == data == L._driver.decode([bytes(p) for p in payloads[: L.k]])
    assert ec.decode(L, KEY, {i: shards[i] for i in range(L.k)}).data == data


def test_fast_path_declines_odd_fragments():
    """Wrong order, wrong size or a parity fragment: left to pyeclib (None)."""
    data = os.urandom(10_001)
    payloads = [ec.parse(L, s, key=KEY, index=i)[1] for i, s in enumerate(shards_of(data))]
    assert ec._concat_data(L, payloads[1:11], len(data)) is None
    assert ec._concat_data(L, payloads[: L.k], len(data) + 1) is None
    assert ec._concat_data(L, payloads[: L.k - 1], len(data)) is None
