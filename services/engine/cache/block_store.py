"""BlockStore: the tensors behind block ids (the data side of the block ledger).

A block covers `block_size` tokens. For each compressed layer it holds that
span's compressed entries, and for CSA layers also the indexer keys:

    entries[layer]     [num_blocks, block_size / m, D]    fp32
    index_keys[layer]  [num_blocks, block_size / m, Di]   fp32   (csa only)

Entry j of a sequence lives in block table[j*m // block_size] at row
(j*m % block_size) // m. BlockPool decides which ids are valid; this class
only reads and writes rows, and (de)serializes whole blocks for the kvstore.
Serialized block = concatenation, in layer order, of entries then index keys.
"""

from __future__ import annotations

import torch

from services.engine.config import ModelConfig


class BlockStore:
    def __init__(self, cfg: ModelConfig, num_blocks: int, dtype=torch.float32):
        self.cfg = cfg
        self.entries: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        for layer in cfg.compressed_layers:
            per = cfg.block_size // cfg.compress_ratio(layer)
            self.entries[layer] = torch.zeros(num_blocks, per, cfg.head_dim, dtype=dtype)
            if cfg.layers[layer] == "csa":
                self.index_keys[layer] = torch.zeros(num_blocks, per, cfg.index_dim, dtype=dtype)

    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size()
                   for t in [*self.entries.values(), *self.index_keys.values()])

    def gather(self, table: list[int], layer: int, n_entries: int, keys: bool = False):
        """The first n_entries rows of a sequence for one layer: [n_entries, D or Di]."""
        src = (self.index_keys if keys else self.entries)[layer]
        if n_entries == 0:
            return src.new_zeros(0, src.shape[-1])
        per = src.shape[1]
        nb = -(-n_entries // per)
        return src[torch.tensor(table[:nb])].reshape(-1, src.shape[-1])[:n_entries]

    def scatter(self, table: list[int], layer: int, first: int, rows, keys: bool = False):
        """Write rows for entries first .. first + len(rows) - 1."""
        if len(rows) == 0:
            return
        dst = (self.index_keys if keys else self.entries)[layer]
        per = dst.shape[1]
        j = torch.arange(first, first + len(rows))
        blocks = torch.tensor(table)[j // per]
        dst[blocks, j % per] = rows.to(dst.dtype)

    def copy_block(self, src: int, dst: int) -> None:
        for t in [*self.entries.values(), *self.index_keys.values()]:
            t[dst] = t[src]

    def serialize(self, block: int) -> bytes:
        assert isinstance(block, int), f"block id must be an int, got {block!r}"
        parts = []
        for layer in self.cfg.compressed_layers:
            parts.append(self.entries[layer][block].contiguous().view(torch.uint8).flatten())
            if layer in self.index_keys:
                parts.append(self.index_keys[layer][block].contiguous().view(torch.uint8).flatten())
        return torch.cat(parts).numpy().tobytes()

    def deserialize(self, block: int, payload: bytes) -> None:
        if len(payload) != self.bytes_per_block():
            raise ValueError(f"block payload is {len(payload)} B, layout needs {self.bytes_per_block()}")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        off = 0
        for layer in self.cfg.compressed_layers:
            for t in ([self.entries[layer]] + ([self.index_keys[layer]] if layer in self.index_keys else [])):
                n = t[block].numel() * t.element_size()
                t[block] = raw[off : off + n].view(t.dtype).view(t[block].shape)
                off += n
