"""runs.py layout arithmetic and the format-2 shard head, checked against real encodings."""

import os

import pytest

from kvmesh.services.kvstore import ec, runs

L = ec.Layout()


@pytest.mark.parametrize("offset,size,expect", [
    (0, 10, [(0, 0, 10)]),                      # inside shard 0
    (95, 10, [(0, 95, 100), (1, 0, 5)]),        # straddles 0 | 1
    (100, 100, [(1, 0, 100)]),                  # exactly shard 1
    (250, 300, [(2, 50, 100), (3, 0, 100), (4, 0, 100), (5, 0, 50)]),
    (999, 1, [(9, 99, 100)]),                   # last byte
    (40, 0, []),                                # empty: touches nothing
])
def test_locate_spans(offset, size, expect):
    spans = runs.locate(offset, size, 100, 10)
    assert [(s.shard, s.start, s.end) for s in spans] == expect
    assert sum(s.end - s.start for s in spans) == size


def test_locate_refuses_bytes_outside_the_run():
    with pytest.raises(ValueError):
        runs.locate(990, 20, 100, 10)


def test_merge_spans_one_range_per_shard():
    spans = runs.locate(10, 20, 100, 10) + runs.locate(60, 80, 100, 10)
    assert runs.merge_spans(spans) == {0: (10, 100), 1: (0, 40)}


def test_split_batches_caps_blocks_and_bytes():
    assert runs.split_batches([1] * 10, 4, 100) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert runs.split_batches([60, 60, 30, 200, 5], 16, 100) == [[0], [1, 2], [3], [4]]


def test_manifest_round_trip_and_malformed():
    m = runs.Manifest((runs.BlockEntry("ab" * 32, 0, 5, 7, "agent", 1.5, b"\x01" * 32),),
                      b"\x02" * 32)
    assert runs.Manifest.unpack(m.pack()) == m
    for bad in (b"", b"{}", b'{"v":9,"digest":"","blocks":[]}', b"[1]"):
        with pytest.raises(ValueError):
            runs.Manifest.unpack(bad)


@pytest.mark.parametrize("size", [1, 1000, 123_457, 2_000_003])
def test_locate_matches_the_real_fragments(size):
    """Every block's bytes, cut from the stored shards at the offsets `fragment_data`
    gives, equal the payload: the systematic layout `locate` assumes holds."""
    data = os.urandom(size)
    shards = ec.encode(L, "run", 1, data, b"{}")
    frag, at = ec.fragment_data(L, shards[0])
    for off, n in [(0, min(size, 7)), (size // 3, size // 3), (size - 1, 1), (0, size)]:
        got = b"".join(shards[s.shard][at + s.start:at + s.end] for s in runs.locate(off, n, frag, 10))
        assert got == data[off:off + n]


def test_shard_head_from_a_prefix_of_a_format_2_shard():
    manifest = b'{"v":1}' * 100
    blob = ec.encode(L, "k" * 32, 9, os.urandom(50_000), manifest)[4]
    need = ec.parse_head(L, blob[:40])
    assert isinstance(need, int)
    while isinstance(need, int):
        need = ec.parse_head(L, blob[:need])
    assert (need.header.index, need.header.generation, need.header.manifest) == (4, 9, manifest)
    assert (need.frag_data, need.data_at) == ec.fragment_data(L, blob)
    rotten = bytearray(blob)
    rotten[60] ^= 1  # inside the manifest: its own crc catches it
    with pytest.raises(ec.ShardError):
        ec.parse_head(L, bytes(rotten))
