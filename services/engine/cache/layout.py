"""RuntimeLayout: every size an engine allocates by, built once from its configs.

    inference SWA ring  = W + B                                   128 + 6 = 134
    kvstore SWA ring    = inference + EXTRA + KEEP   (extra-state on, truncation on)
                                                                  134 + 128 + 134 = 396
                        = inference + EXTRA          (extra-state on, truncation off)
                                                                  134 + 128 = 262
                        = inference                  (extra-state off)     134
    compression ring    = m + B                                   CSA 10, HCA 134
    MTP ring            = W + B  (--speculative mtp:K only)       134

This engine's slots use the kvstore ring (it equals the inference ring unless
extra-state is on); snapshots are always cut in the inference layout.

Memory of one engine's cache (weights and the host snapshot store apart):

    | slot 0 | slot 1 | ... | slot S-1 |  S x slot_bytes       StatePool.data
    | replica 0 | ...     | replica S-1 |  S x replica_bytes    decode snapshot copies
    | block 0 | block 1 | ... | block N-1 |  N x block_bytes     BlockStore tensors

Owner: nobody changes it (frozen). `RuntimeLayout.build` is the only place
that turns EngineConfig + ModelConfig into sizes; the engine, its StatePool,
CacheManager, snapshot code and `kvmesh engine layout` all read the same
object. Nothing here reads the environment (see EngineConfig.from_flags).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.cache.state_layout import FP32, StateBlock
from services.engine.config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class MemoryFit:
    """How a byte budget splits: the configured slots first, blocks from the rest."""

    budget: int
    slots: int          # min(num_slots, what fits)
    blocks: int         # blocks the remainder holds
    max_slots: int      # slots alone, if no block were kept
    spare: int          # bytes left over


@dataclass(frozen=True)
class RuntimeLayout:
    model: ModelConfig
    engine: EngineConfig
    inference_ring: int                 # W + B: the ring snapshots are cut in
    kvstore_terms: tuple[int, ...]      # (inference, EXTRA, KEEP) or fewer: see the diagram
    block: StateBlock                   # byte layout of one slot of this engine's StatePool

    def __post_init__(self):
        if (self.block.swa_ring, self.block.inference_ring, self.block.backtrack) != \
                (self.kvstore_ring, self.inference_ring, self.backtrack):
            raise AssertionError("slot layout built with other ring sizes than the runtime layout")

    @classmethod
    def build(cls, model: ModelConfig, engine: EngineConfig) -> RuntimeLayout:
        engine.check_model(model)
        inference = model.window + engine.max_backtrack
        terms: tuple[int, ...] = (inference,)
        if engine.extra_state:
            terms += (engine.extra_state_size,)
            # KEEP rows only matter while truncation is on: with it off, prefill runs the
            # decoder over every token and no kept span has to be re-assembled.
            if engine.truncation != "off":
                terms += (engine.keep_tokens,)
        # the MTP drafter's ring exists only on an engine that drafts with it
        # (the syntax and K are checked by core/speculative.py engine_setting)
        mtp_rings = 1 if engine.speculative.strip().partition(":")[0] == "mtp" else 0
        block = StateBlock(model, sum(terms), inference, engine.max_backtrack, mtp_rings)
        block.regions()   # walks the tensors once: a drift fails here, before any allocation
        return cls(model, engine, inference, terms, block)

    @property
    def kvstore_ring(self) -> int:
        """This engine's slot ring: inference ring, + EXTRA (+ KEEP) with extra-state."""
        return sum(self.kvstore_terms)

    # --- ring sizes -----------------------------------------------------------------
    @property
    def backtrack(self) -> int:
        return self.engine.max_backtrack

    @property
    def slot_ring(self) -> int:
        """Rows of each SWA ring in this engine's slots."""
        return self.block.swa_ring

    def compress_ring(self, m: int) -> int:
        """Tail of the open group (< m tokens) plus B rows of rollback history."""
        return m + self.backtrack

    # --- bytes ------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.engine.num_slots

    @property
    def num_blocks(self) -> int:
        return self.engine.num_blocks

    @property
    def replica_bytes(self) -> int:
        """Per slot: the decode replica (the encoder window in the inference layout)."""
        return self.model.n_encoder_layers * self.inference_ring * self.model.swa_bytes_per_token

    @property
    def slot_total_bytes(self) -> int:
        return self.block.slot_bytes + self.replica_bytes

    @property
    def block_bytes(self) -> int:
        """One cache block (block_size tokens): compressed entries, plus indexer keys on CSA."""
        cfg, total = self.model, 0
        for layer in cfg.compressed_layers:
            rows = cfg.block_size // cfg.compress_ratio(layer)
            dims = cfg.head_dim + (cfg.index_dim if cfg.layers[layer] == "csa" else 0)
            total += rows * dims * FP32
        return total

    @property
    def cache_bytes(self) -> int:
        """What the configured slots and blocks take."""
        return self.num_slots * self.slot_total_bytes + self.num_blocks * self.block_bytes

    @property
    def snapshots_in_store(self) -> int:
        """Snapshots the host snapshot store holds at its byte budget."""
        return self.engine.snapshot_bytes // self.block.state_size_to_disk

    def fit(self, budget: int) -> MemoryFit:
        """Slots and blocks that fit `budget` bytes: the configured number of slots is
        reserved first (fewer if even they do not fit), the rest holds blocks."""
        if budget < 0:
            raise ValueError(f"memory budget must be >= 0 bytes, not {budget}")
        per_slot = self.slot_total_bytes
        slots = min(self.num_slots, budget // per_slot)
        rest = budget - slots * per_slot
        blocks = rest // self.block_bytes
        return MemoryFit(budget, slots, blocks, budget // per_slot, rest - blocks * self.block_bytes)
