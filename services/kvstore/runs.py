"""Runs: several blocks stored as one erasure-coded object. Pure: no I/O.

A batch of up to `run_blocks` blocks (the engines' write-through batches
consecutive blocks of one prefix) is concatenated into one payload and encoded
once: each of the 12 locations holds ONE shard object `run/<run id>` for the
whole run, instead of one per block. The code is systematic, so data shard i
holds payload bytes [i*F, (i+1)*F) verbatim after its 80-byte pyeclib header:

    payload   | block a | block b |  block c  | ... |             (run size S)
    data shard 0: [0, F)   1: [F, 2F)   ...   9: [9F, S) + zero padding
    stored shard object:  head+key+manifest | frag header 80 | F bytes | crc
                          `----------- data_at ------------'^

A block at payload [off, off+len) lies in shards off//F .. (off+len-1)//F:
one or two of them for a block up to F bytes, so a healthy read of one block is
one or two ranged GETs (`locate`); its blake3 digest (in the manifest and the
index) checks the bytes, since a ranged read cannot check the shard's crc32.

The manifest (JSON, in every shard of the run, format 2 of ec.py) carries what
the index needs to be rebuilt from the locations alone (`kvmesh admin reindex`):
per block key, offset, size, generation, traffic class, created time and
digest, plus the digest of the whole payload. A single-block object (`blk/`)
carries a one-entry manifest too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

RUN_ID_HEX = 32  # random run ids: 128 bits, never reused, so a run is never overwritten
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class BlockEntry:
    """One block of a run (or the only block of a single object)."""

    key: str
    offset: int  # in the run payload
    size: int
    generation: int
    traffic_class: str
    created: float
    digest: bytes


@dataclass(frozen=True)
class Manifest:
    blocks: tuple[BlockEntry, ...]
    digest: bytes  # blake3 of the whole payload

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blocks)

    def pack(self) -> bytes:
        return json.dumps({
            "v": MANIFEST_VERSION, "digest": self.digest.hex(),
            "blocks": [[b.key, b.offset, b.size, b.generation, b.traffic_class, b.created,
                        b.digest.hex()] for b in self.blocks],
        }, separators=(",", ":")).encode()

    @classmethod
    def unpack(cls, raw: bytes) -> Manifest:
        """ValueError on anything malformed (the caller treats the shard as unusable)."""
        try:
            doc = json.loads(raw)
            if doc["v"] != MANIFEST_VERSION:
                raise ValueError(f"manifest version {doc['v']}")
            blocks = tuple(BlockEntry(str(k), int(o), int(n), int(g), str(tc), float(c),
                                      bytes.fromhex(d))
                           for k, o, n, g, tc, c, d in doc["blocks"])
            return cls(blocks, bytes.fromhex(doc["digest"]))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed manifest: {exc}") from None


def layout_blocks(sizes: list[int]) -> list[int]:
    """Payload offsets of blocks of these sizes, packed back to back."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def split_batches(sizes: list[int], max_blocks: int, max_bytes: int) -> list[list[int]]:
    """Indexes of a put batch grouped into runs of <= max_blocks blocks and <= max_bytes
    (a single block larger than max_bytes gets a run of its own)."""
    runs: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, n in enumerate(sizes):
        if cur and (len(cur) >= max_blocks or cur_bytes + n > max_bytes):
            runs.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += n
    if cur:
        runs.append(cur)
    return runs


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of data shard `shard`'s fragment data (0 = first byte after
    the pyeclib header), holding payload bytes [payload_at, payload_at + end - start)."""

    shard: int
    start: int
    end: int
    payload_at: int


def locate(offset: int, size: int, frag_data: int, k: int) -> list[Span]:
    """The data-shard spans holding payload bytes [offset, offset + size)."""
    if size == 0:
        return []
    if frag_data <= 0 or offset < 0 or offset + size > frag_data * k:
        raise ValueError(f"bytes [{offset}, {offset + size}) outside {k} x {frag_data}")
    out = []
    at, end = offset, offset + size
    while at < end:
        shard = at // frag_data
        stop = min(end, (shard + 1) * frag_data)
        out.append(Span(shard, at - shard * frag_data, stop - shard * frag_data, at))
        at = stop
    return out


def merge_spans(spans: list[Span]) -> dict[int, tuple[int, int]]:
    """Per data shard, the one byte range covering all `spans` in it (one GET each)."""
    out: dict[int, tuple[int, int]] = {}
    for s in spans:
        lo, hi = out.get(s.shard, (s.start, s.end))
        out[s.shard] = (min(lo, s.start), max(hi, s.end))
    return out
