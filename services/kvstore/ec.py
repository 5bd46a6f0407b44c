"""Erasure-coded shard layout: encode an object into 12 self-describing shards
and decode any 10 healthy ones back. Pure: no I/O, no clocks, no asyncio.

One object = K data + M parity shards (10 + 2, pyeclib `isa_l_rs_vand`). Each
shard is stored as one S3 object and carries everything needed to check it on
its own:

    offset  size  field
    ------  ----  -----------------------------------------------------------
         0     4  magic  b"KVSH"
         4     1  format version (1, or 2 = with manifest, below)
         5     1  k  (data shards)
         6     1  m  (parity shards)
         7     1  shard index 0..k+m-1
         8     4  layout fingerprint: crc32("k/m/backend/format")
        12     8  generation (random per put; shards of two puts never mix)
        20     8  object size in bytes
        28     4  fragment size in bytes (= payload length)
        32     2  key length n
        34     n  key (ascii lowercase hex)
      34+n     F  payload: the pyeclib fragment (its own 80-byte header + data)
    34+n+F     4  crc32 of bytes [0, 34+n+F)   (header + key + payload)

Format 2 (written now; 1 is still read) inserts a manifest after the key, so
that one shard of an object or run rebuilds its index entries (runs.py):

      34+n     4  manifest length M
      38+n     M  manifest (runs.py: keys, offsets, sizes, generations, ...)
    38+n+M     4  crc32 of bytes [0, 38+n+M)   (a ranged GET of the head checks it)
    42+n+M     F  payload, then the crc32 of everything as in format 1

All integers little-endian. A shard whose checksum, magic, fingerprint, key,
index or size fields do not match what the reader expects counts as lost,
exactly like a shard on a dead server. crc32 (zlib's polynomial) was chosen
over sha256: it detects bit rot and torn writes, which is the threat here (not
tampering). It is computed by ISA-L (python-isal), which gives the same values
as `zlib.crc32` at ~56 GB/s instead of ~4 GB/s on the CI box (cache-warm): the
checksum went from 13.5 % to 3.4 % of the kvstore's CPU samples on S3-path gets.

The crc32 does not protect against a shard rewritten with a valid trailer (a
buggy writer, or anyone with write access to a bucket): `decode` can also check
the reassembled object against its blake3 digest recorded at put time. On a
mismatch it tries the other k-subsets of the healthy shards (at most
C(n, k) = 66 decodes for 10+2) and names the shards that disagree with the
object that matches; if none matches, `DigestMismatch` (treated as a miss).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from blake3 import blake3
from isal.isal_zlib import crc32

MAGIC = b"KVSH"
FORMAT_V1 = 1  # one object, no manifest (still read)
FORMAT_VERSION = 2  # written now: a manifest section after the key (runs.py)
LAYOUT_FORMAT = 1  # in the layout fingerprint: unchanged by v2 (same fragment layout)
_HEADER = struct.Struct("<4sBBBBIQQIH")
_CRC = struct.Struct("<I")
_MLEN = struct.Struct("<I")
HEADER_SIZE = _HEADER.size  # 34, without the key

# liberasurecode's fragment header (80 bytes, host order = little-endian here):
# idx u32 @0, data size u32 @4, backend metadata size u32 @8, original object
# size u64 @12, ..., magic u32 @59. Read only by the all-data-shards fast path.
_FRAG_HEADER_SIZE = 80
_FRAG_META = struct.Struct("<IIIQ")
_FRAG_MAGIC = struct.Struct("<I")
_FRAG_MAGIC_OFFSET = 59
_LIBEC_MAGIC = 0x0B0C5ECC


class ShardError(ValueError):
    """This shard cannot be used (corrupt, foreign, truncated); treat it as lost."""


class NotEnoughShards(Exception):
    """Fewer than k healthy shards of one generation: the object is unreadable."""


class DigestMismatch(NotEnoughShards):
    """Enough shards passed their checks, but no k of them rebuild the object
    whose digest was recorded: unreadable, exactly like too few shards."""


DIGEST_SIZE = 32


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """The object digest recorded at put time (blake3, 32 bytes)."""
    return blake3(data).digest()


@dataclass(frozen=True)
class ShardHeader:
    index: int
    generation: int
    object_size: int
    fragment_size: int
    key: str
    fingerprint: int
    version: int = FORMAT_V1
    manifest: bytes = b""  # v2: the run/object manifest (runs.py), checked by its own crc
    payload_offset: int = 0  # where the pyeclib fragment starts in the stored shard


@dataclass(frozen=True)
class Layout:
    """The erasure-code parameters; its fingerprint is written into every shard."""

    k: int = 10
    m: int = 2
    backend: str = "isa_l_rs_vand"

    def __post_init__(self) -> None:
        if not (1 <= self.k <= 32 and 1 <= self.m <= 8):
            raise ValueError(f"unsupported layout k={self.k} m={self.m}")

    @property
    def n(self) -> int:
        return self.k + self.m

    @property
    def fingerprint(self) -> int:
        return zlib.crc32(f"{self.k}/{self.m}/{self.backend}/{LAYOUT_FORMAT}".encode())

    @cached_property
    def _driver(self) -> Any:  # pyeclib's ECDriver; pyeclib ships no type information
        from pyeclib.ec_iface import ECDriver

        return ECDriver(k=self.k, m=self.m, ec_type=self.backend)

    def shard_bytes(self, object_size: int, key: str) -> int:
        """Stored bytes of one shard (header + payload + crc) for planning and stats."""
        frag = -(-max(object_size, 1) // self.k) + 80
        return HEADER_SIZE + len(key) + frag + _CRC.size


def encode(layout: Layout, key: str, generation: int, data: bytes,
           manifest: bytes | None = None) -> list[bytes]:
    """The n shards of `data`, index i at position i. With `manifest`: format v2
    (the manifest is copied into every shard, so any one shard can rebuild the index)."""
    fragments = layout._driver.encode(bytes(data))
    return [
        _pack(layout, key, i, generation, len(data), frag, manifest)
        for i, frag in enumerate(fragments)
    ]


def _pack(layout: Layout, key: str, index: int, generation: int, size: int, frag: bytes,
          manifest: bytes | None = None) -> bytes:
    kb = key.encode("ascii")
    version = FORMAT_V1 if manifest is None else FORMAT_VERSION
    head = _HEADER.pack(
        MAGIC, version, layout.k, layout.m, index, layout.fingerprint,
        generation, size, len(frag), len(kb),
    )
    parts = [head, kb]
    if manifest is not None:  # v2: manifest length, manifest, crc32 of everything so far
        parts += [_MLEN.pack(len(manifest)), manifest]
        parts.append(_CRC.pack(crc32(b"".join(parts))))
    parts.append(frag)
    crc = 0
    for part in parts:
        crc = crc32(part, crc)
    parts.append(_CRC.pack(crc))
    return b"".join(parts)


def fragment_offset(key: str, manifest_len: int | None) -> int:
    """Byte offset of the pyeclib fragment inside a stored shard (v1: None)."""
    base = HEADER_SIZE + len(key)
    return base if manifest_len is None else base + _MLEN.size + manifest_len + _CRC.size


def fragment_data(layout: Layout, blob: bytes) -> tuple[int, int]:
    """(F, at) of a freshly encoded shard: data shard i holds payload bytes [i*F, (i+1)*F),
    starting at byte `at` of the stored shard object (runs.locate uses both)."""
    head, payload = parse(layout, blob)
    idx, fsize, meta_size, orig = _FRAG_META.unpack_from(payload)
    (magic,) = _FRAG_MAGIC.unpack_from(payload, _FRAG_MAGIC_OFFSET)
    if magic != _LIBEC_MAGIC or meta_size != 0 or len(payload) != _FRAG_HEADER_SIZE + fsize:
        raise ShardError("unexpected pyeclib fragment header: no ranged reads for this layout")
    return fsize, head.payload_offset + _FRAG_HEADER_SIZE


@dataclass(frozen=True)
class Head:
    """What the first bytes of a stored shard say (`parse_head`, for reindex)."""

    header: ShardHeader
    frag_data: int  # payload bytes per data shard (F), from the pyeclib fragment header
    data_at: int  # where fragment data starts in the stored shard


def _header(layout: Layout, buf: bytes | memoryview) -> tuple[int, int, int, int, int, int, int]:
    """(version, index, fp, generation, size, frag, key length), checked against `layout`."""
    magic, ver, k, m, idx, fp, gen, size, frag, klen = _HEADER.unpack_from(buf)
    if magic != MAGIC or ver not in (FORMAT_V1, FORMAT_VERSION):
        raise ShardError("not a kvstore shard (magic/version)")
    if (k, m, fp) != (layout.k, layout.m, layout.fingerprint):
        raise ShardError(f"layout mismatch: shard k={k} m={m} fp={fp:#x}")
    return ver, idx, fp, gen, size, frag, klen


def parse_head(layout: Layout, prefix: bytes) -> Head | int:
    """Header, manifest and fragment layout of a shard from its first bytes (a ranged
    GET). v2: the manifest is checked by its own crc32; v1 (no manifest) header fields
    are taken as they are (only the whole shard's crc covers them; decode checks again).
    Returns how many bytes are needed when `prefix` is too short; ShardError if unusable."""
    need = HEADER_SIZE + _MLEN.size + 512
    if len(prefix) < HEADER_SIZE:
        return need
    ver, idx, fp, gen, size, frag, klen = _header(layout, prefix)
    at = HEADER_SIZE + klen
    manifest, start = b"", at
    if ver == FORMAT_VERSION:
        if len(prefix) < at + _MLEN.size:
            return need + klen
        (mlen,) = _MLEN.unpack_from(prefix, at)
        end = at + _MLEN.size + mlen
        if len(prefix) < end + _CRC.size:
            return end + _CRC.size + _FRAG_HEADER_SIZE
        (crc,) = _CRC.unpack_from(prefix, end)
        if crc32(prefix[:end]) != crc:
            raise ShardError("manifest checksum mismatch")
        manifest, start = bytes(prefix[at + _MLEN.size:end]), end + _CRC.size
    if len(prefix) < start + _FRAG_HEADER_SIZE:
        return start + _FRAG_HEADER_SIZE
    _, fsize, _, _ = _FRAG_META.unpack_from(prefix, start)
    skey = bytes(prefix[HEADER_SIZE:at]).decode("ascii", "replace")
    head = ShardHeader(idx, gen, size, frag, skey, fp, ver, manifest, start)
    return Head(head, fsize, start + _FRAG_HEADER_SIZE)


def parse(layout: Layout, blob: bytes, key: str | None = None,
          index: int | None = None) -> tuple[ShardHeader, memoryview]:
    """Check one stored shard and return its header and payload (a view, no copy).

    Raises ShardError for anything that makes the shard unusable, including a
    shard of another key or index (a misplaced write is as bad as a lost one).
    """
    if len(blob) < HEADER_SIZE + _CRC.size:
        raise ShardError(f"truncated shard ({len(blob)} bytes)")
    ver, idx, fp, gen, size, frag, klen = _header(layout, blob)
    start = HEADER_SIZE + klen
    manifest = b""
    view = memoryview(blob)
    if ver == FORMAT_VERSION:
        if len(blob) < start + _MLEN.size:
            raise ShardError("truncated manifest")
        (mlen,) = _MLEN.unpack_from(blob, start)
        manifest = bytes(view[start + _MLEN.size:start + _MLEN.size + mlen])
        start += _MLEN.size + mlen + _CRC.size
    end = start + frag
    if len(blob) != end + _CRC.size:
        raise ShardError(f"length mismatch: {len(blob)} != {end + _CRC.size}")
    (crc,) = _CRC.unpack_from(blob, end)
    if crc32(view[:end]) != crc:
        raise ShardError("checksum mismatch")
    skey = bytes(view[HEADER_SIZE:HEADER_SIZE + klen]).decode("ascii", "replace")
    if key is not None and skey != key:
        raise ShardError(f"shard belongs to key {skey!r}")
    if index is not None and idx != index:
        raise ShardError(f"shard index {idx} stored at position {index}")
    head = ShardHeader(idx, gen, size, frag, skey, fp, ver, manifest, start)
    return head, view[start:end]


@dataclass(frozen=True)
class Decoded:
    data: bytes
    generation: int
    healthy: frozenset[int]  # shard indexes that passed checks, of the chosen generation
    missing: frozenset[int]  # indexes absent, corrupt or of another generation
    forged: frozenset[int] = frozenset()  # of `missing`: passed every check, wrong content
    manifest: bytes | None = None  # v2 shards: the manifest most healthy shards carry


def decode(layout: Layout, key: str, blobs: dict[int, bytes | None],
           generation: int | None = None, expect: bytes | None = None,
           verify_all: bool = False) -> Decoded:
    """Rebuild the object from whatever shards were fetched (index -> bytes or None).

    With `generation` given only shards of that put count; otherwise the
    generation most shards agree on wins. With `expect` (the recorded digest)
    the result must match it (see the module doc). Raises NotEnoughShards
    below k, DigestMismatch when no k healthy shards give the recorded object.
    `verify_all` (scrub): also compare every other healthy shard with a fresh
    encoding of the result, so a forged shard that decode did not use is found.
    """
    parsed: dict[int, tuple[ShardHeader, memoryview]] = {}
    for i, blob in blobs.items():
        if blob is None:
            continue
        try:
            parsed[i] = parse(layout, blob, key=key, index=i)
        except ShardError:
            continue
    if generation is None and parsed:
        generation = Counter(h.generation for h, _ in parsed.values()).most_common(1)[0][0]
    good = {i: hp for i, hp in parsed.items() if hp[0].generation == generation}
    sizes = Counter(h.object_size for h, _ in good.values())
    if len(sizes) > 1:  # same generation, different sizes: keep the majority
        size = sizes.most_common(1)[0][0]
        good = {i: hp for i, hp in good.items() if hp[0].object_size == size}
    if len(good) < layout.k:
        raise NotEnoughShards(f"{key}: {len(good)} healthy shards, need {layout.k}")
    # every shard left has one generation and size: read both from one header (`generation`
    # may still be None here for the type checker, never in fact once `good` is non-empty)
    head = next(iter(good.values()))[0]
    size, gen = head.object_size, head.generation
    manifest = _majority_manifest(good)
    everything = frozenset(range(layout.n))
    first = sorted(good)[: layout.k]
    data = _assemble(layout, key, good, first, size)
    if expect is None or (data is not None and digest(data) == expect):
        if data is None:
            raise NotEnoughShards(f"{key}: decoded size disagrees with the header ({size})")
        if verify_all and expect is not None:  # without a digest, no shard is the judge
            return _verified(layout, key, blobs, good, gen, data, manifest)
        return Decoded(data, gen, frozenset(good), everything - set(good), manifest=manifest)
    for chosen in itertools.combinations(sorted(good), layout.k):
        if list(chosen) == first:
            continue
        data = _assemble(layout, key, good, list(chosen), size)
        if data is not None and digest(data) == expect:
            return _verified(layout, key, blobs, good, gen, data, manifest)
    raise DigestMismatch(f"{key}: no {layout.k} of {len(good)} healthy shards match the "
                         "recorded digest")


def _majority_manifest(good: dict[int, tuple[ShardHeader, memoryview]]) -> bytes | None:
    """The manifest most healthy shards carry (None: v1 shards, which have none)."""
    if all(h.version == FORMAT_V1 for h, _ in good.values()):
        return None
    return Counter(h.manifest for h, _ in good.values()).most_common(1)[0][0]


def _verified(layout: Layout, key: str, blobs: dict[int, bytes | None], good: dict,
              generation: int, data: bytes, manifest: bytes | None = None) -> Decoded:
    """`data` is right: every healthy shard that differs from its fresh encoding is forged."""
    fresh = encode(layout, key, generation, data, manifest)
    forged = frozenset(i for i in good if blobs[i] != fresh[i])   # `good` shards parsed: not None
    healthy = frozenset(good) - forged
    return Decoded(data, generation, healthy, frozenset(range(layout.n)) - healthy, forged,
                   manifest)


def _assemble(layout: Layout, key: str, good: dict[int, tuple[ShardHeader, memoryview]],
              chosen: list[int], size: int) -> bytes | None:
    """The object from the chosen k shards; None if they do not decode to `size` bytes."""
    from pyeclib.ec_iface import ECDriverError

    data = _concat_data(layout, [good[i][1] for i in chosen], size)
    if data is None:
        try:
            data = layout._driver.decode([bytes(good[i][1]) for i in chosen])
        except ECDriverError:  # a forged fragment header: this subset is unusable
            return None
    return data if len(data) == size else None


def _concat_data(layout: Layout, payloads: list[memoryview], size: int) -> bytes | None:
    """The object straight from the k data fragments, or None to leave it to pyeclib.

    The code is systematic: fragment i < k carries bytes [i*F, (i+1)*F) of the
    object after its 80-byte header, zero-padded at the end. When the chosen
    fragments are exactly 0..k-1 (checksums already passed) decoding is a
    concatenation; pyeclib would copy every fragment twice more to do the same.
    Anything unexpected in a fragment header falls back to the real decoder.
    """
    k = layout.k
    if len(payloads) != k:
        return None
    pieces: list[memoryview] = []
    left = size
    frag_size = None
    for i, frag in enumerate(payloads):
        if len(frag) < _FRAG_HEADER_SIZE:
            return None
        idx, fsize, meta_size, orig = _FRAG_META.unpack_from(frag)
        (magic,) = _FRAG_MAGIC.unpack_from(frag, _FRAG_MAGIC_OFFSET)
        if (magic != _LIBEC_MAGIC or idx != i or orig != size or meta_size != 0
                or len(frag) != _FRAG_HEADER_SIZE + fsize or frag_size not in (None, fsize)):
            return None
        frag_size = fsize
        take = min(fsize, left)
        pieces.append(frag[_FRAG_HEADER_SIZE:_FRAG_HEADER_SIZE + take])
        left -= take
    if left:
        return None
    return b"".join(pieces)


def rebuild(layout: Layout, key: str, decoded: Decoded, indexes: list[int]) -> dict[int, bytes]:
    """Fresh shards for `indexes` (the repair path), re-encoded from the data."""
    shards = encode(layout, key, decoded.generation, decoded.data, decoded.manifest)
    return {i: shards[i] for i in indexes}
