"""BlockStore: the tensors behind block ids (the data side of the block ledger).

A block covers `block_size` tokens. For each compressed layer it holds that
span's compressed entries, and for CSA layers also the indexer keys:

    entries[layer]     [num_blocks, block_size / m, D]    fp32
    index_keys[layer]  [num_blocks, block_size / m, Di]   fp32   (csa only)

Entry j of a sequence lives in block table[j*m // block_size] at row
(j*m % block_size) // m. BlockPool decides which ids are valid; this class
only reads and writes rows, and (de)serializes whole blocks for the kvstore.

Serialized block (what the kvstore stores under the block's hash):

    offset  size  field
         0     4  magic b"KVBK"
         4     1  format version (1)
         5     3  zero
         8     4  layout fingerprint: crc32 of every tensor's shape and dtype, in order
        12     4  payload size P (u32, little-endian)
        16     P  payload: in layer order, the block's entries then index keys (raw)
      16+P    32  blake3 of bytes [0, 16+P)

`deserialize` checks all of it (size, magic, layout, digest) before writing a
single row: a block that was damaged or rewritten anywhere between the engine
that made it and this one is refused (a miss), never installed.
"""

from __future__ import annotations

import struct
import zlib
from typing import Protocol

import torch
from blake3 import blake3

from kvmesh.kernels import host_memory
from kvmesh.services.engine import device as device_mod

BLOCK_MAGIC = b"KVBK"
BLOCK_VERSION = 1
_HEAD = struct.Struct("<4sB3xII")
DIGEST_SIZE = 32
OVERHEAD = _HEAD.size + DIGEST_SIZE  # 48 bytes on top of the raw rows


class Geometry(Protocol):
    """What a BlockStore reads of a model (model/deepseek_v4/ledgers.py BlockGeometry)."""
    block_size: int
    head_dim: int
    index_dim: int
    layers: tuple[str, ...]              # "swa" | "csa" | "hca" per layer
    compressed_layers: list[int]

    def compress_ratio(self, layer: int) -> int | None: ...


class BlockStore:
    def __init__(self, cfg: Geometry, num_blocks: int, dtype=torch.float32, device="cpu"):
        self.cfg = cfg
        self.entries: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        for layer in cfg.compressed_layers:
            per = cfg.block_size // cfg.compress_ratio(layer)
            # on 2 MB pages: decode rows read entries 2 KB at a time, all over the store
            self.entries[layer] = host_memory.zeros((num_blocks, per, cfg.head_dim), dtype, device)
            if cfg.layers[layer] == "csa":
                self.index_keys[layer] = host_memory.zeros((num_blocks, per, cfg.index_dim), dtype,
                                                           device)

    def _tensors(self) -> list[torch.Tensor]:
        out = []
        for layer in self.cfg.compressed_layers:
            out.append(self.entries[layer])
            if layer in self.index_keys:
                out.append(self.index_keys[layer])
        return out

    def payload_bytes(self) -> int:
        """Raw rows of one block (the serialized block adds `OVERHEAD`)."""
        return sum(t[0].numel() * t.element_size() for t in self._tensors())

    def bytes_per_block(self) -> int:
        """Size of one serialized block: header + rows + digest."""
        return self.payload_bytes() + OVERHEAD

    def layout_fp(self) -> int:
        desc = ";".join(f"{tuple(t.shape[1:])}:{t.dtype}" for t in self._tensors())
        return zlib.crc32(f"block/{BLOCK_VERSION}/{desc}".encode())

    def gather(self, table: list[int], layer: int, n_entries: int, keys: bool = False):
        """The first n_entries rows of a sequence for one layer: [n_entries, D or Di]."""
        src = (self.index_keys if keys else self.entries)[layer]
        if n_entries == 0:
            return src.new_zeros(0, src.shape[-1])
        per = src.shape[1]
        nb = -(-n_entries // per)
        return src[torch.tensor(table[:nb], device=src.device)].reshape(-1, src.shape[-1])[:n_entries]

    def scatter(self, table: list[int], layer: int, first: int, rows, keys: bool = False):
        """Write rows for entries first .. first + len(rows) - 1."""
        if len(rows) == 0:
            return
        dst = (self.index_keys if keys else self.entries)[layer]
        per = dst.shape[1]
        j = torch.arange(first, first + len(rows), device=dst.device)
        blocks = torch.tensor(table, device=dst.device)[j // per]
        dst[blocks, j % per] = rows.to(dst.dtype)

    def copy_block(self, src: int, dst: int) -> None:
        for t in [*self.entries.values(), *self.index_keys.values()]:
            t[dst] = t[src]

    def serialize(self, block: int) -> bytes:
        return self.frame(self.raw(block).cpu().numpy().tobytes())

    def raw(self, block: int) -> torch.Tensor:
        """A block's rows as one uint8 tensor on the store's device (a copy: the block may be
        rewritten later); `frame` of its bytes is `serialize`. The engine copies it to the
        host off the decode step (device.HostCopies) and frames it there."""
        assert isinstance(block, int), f"block id must be an int, got {block!r}"
        return torch.cat([t[block].contiguous().view(torch.uint8).flatten() for t in self._tensors()])

    def frame(self, payload: bytes) -> bytes:
        """Header, payload and digest: a serialized block."""
        head = _HEAD.pack(BLOCK_MAGIC, BLOCK_VERSION, self.layout_fp(), len(payload))
        return b"".join((head, payload, blake3(head + payload).digest()))

    def check(self, blob: bytes) -> memoryview:
        """The rows of a serialized block after checking size, header, layout and digest;
        ValueError naming the first problem."""
        want = self.bytes_per_block()
        if len(blob) != want:
            raise ValueError(f"block is {len(blob)} B, this layout's blocks are {want} B")
        magic, version, fp, size = _HEAD.unpack_from(blob)
        if magic != BLOCK_MAGIC or version != BLOCK_VERSION:
            raise ValueError(f"not a kvmesh block (magic {magic!r}, version {version})")
        if fp != self.layout_fp() or size != self.payload_bytes():
            raise ValueError(f"block layout {fp:#x}/{size} B, this engine's is "
                             f"{self.layout_fp():#x}/{self.payload_bytes()} B")
        view = memoryview(blob)
        end = _HEAD.size + size
        if blake3(view[:end]).digest() != bytes(view[end:]):
            raise ValueError("block digest mismatch: damaged or rewritten")
        return view[_HEAD.size:end]

    def deserialize(self, block: int, blob: bytes) -> None:
        """Install a serialized block; ValueError (nothing written) if it fails `check`."""
        raw = torch.frombuffer(bytearray(self.check(blob)), dtype=torch.uint8)
        raw = device_mod.upload(raw, next(iter(self._tensors())).device) if self._tensors() else raw
        off = 0
        for t in self._tensors():
            n = t[block].numel() * t.element_size()
            t[block] = raw[off : off + n].view(t.dtype).view(t[block].shape)
            off += n
