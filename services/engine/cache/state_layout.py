"""StateBlock: the byte layout of one state slot.

One slot per running sequence, fixed size, no indirection. With E encoder and
D decoder layers, SWA ring length R (134, or 396 on a prefill engine with
extra-state), compression rings of m + B tokens:

    offset 0
    | enc SWA ring 0 | enc SWA ring 1 | ... | enc SWA ring E-1 |          stored region
    |<------------- E * R * 528 B (uint8, MXFP8) ------------->|
    | dec SWA ring 0 | ... | dec SWA ring D-1 |                          dropped: consumer SWA
    | cmp state L_a | idx state L_a | cmp state L_b | ... |               dropped: compression state
       (m+B) x 2 x 512 fp32   (m+B) x 2 x Di fp32 (CSA only)              (v and gate z per token)
    | MTP ring 0 |  (W + B) x 528 B, only with --speculative mtp:K        dropped: drafter state

Each SWA ring row is one token, ring index = position % R:

    | 512 B E4M3 values | 16 B E8M0 scales |  = 528 B

The MTP ring (model/mtp.py, the drafter's own SWA layer) always has the inference ring's
W + B rows, whatever R is: drafts only need the last W positions plus B of rollback. It
comes after everything else, so the stored prefix, the snapshots and the handoff state
(cache/handoff.py) are the same with or without it; it is rebuilt from the hidden states
the engine computes after an admission, never persisted or handed off.

Persisting a slot is a prefix cut: the first `state_size_to_disk` bytes of the
slot in the inference layout (R = 134), i.e. E * 134 * 528 B. For v41-flash:
20 * 134 * 528 = 1,415,040 B. Which layers are dropped depends on the model
config only (decoder = YOCO consumer), never on a runtime switch.

`StateBlock` is built by `RuntimeLayout` (layout.py), which decides R and B;
it precomputes every size in closed form; `LayoutBuilder` walks the
tensors one by one as the pool lays them out; `finalize()` insists the two
agree (a mismatch means corrupted memory, not slowness).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.config import ModelConfig

FP32 = 4


def is_dropped_swa_layer(cfg: ModelConfig, layer: int) -> bool:
    """YOCO consumer SWA (decoder layers) is rebuilt by prefill, never persisted."""
    return not cfg.is_encoder(layer)


@dataclass(frozen=True)
class Region:
    name: str
    layer: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]   # of the typed view
    dtype: str               # "uint8" | "float32"


@dataclass(frozen=True)
class StateBlock:
    """Closed-form sizes of one slot for (config, ring length)."""

    cfg: ModelConfig
    swa_ring: int                       # R of this pool
    inference_ring: int                 # 134 with the defaults
    backtrack: int
    mtp_rings: int = 0                  # MTP drafter rings (1 with --speculative mtp:K)

    @property
    def swa_token_bytes(self) -> int:
        return self.cfg.swa_bytes_per_token

    @property
    def n_stored_layers(self) -> int:
        return sum(not is_dropped_swa_layer(self.cfg, i) for i in range(self.cfg.n_layers))

    @property
    def stored_bytes(self) -> int:
        """Stored region of this pool's slots (R-long rings)."""
        return self.n_stored_layers * self.swa_ring * self.swa_token_bytes

    @property
    def state_size_to_disk(self) -> int:
        """Bytes persisted per sequence: stored layers' rings in the inference layout."""
        return self.n_stored_layers * self.inference_ring * self.swa_token_bytes

    @property
    def consumer_swa_bytes(self) -> int:
        n = self.cfg.n_layers - self.n_stored_layers
        return n * self.swa_ring * self.swa_token_bytes

    @property
    def compression_bytes(self) -> int:
        total = 0
        for layer in self.cfg.compressed_layers:
            r = self.backtrack + self.cfg.compress_ratio(layer)
            total += r * 2 * self.cfg.head_dim * FP32
            if self.cfg.layers[layer] == "csa":
                total += r * 2 * self.cfg.index_dim * FP32
        return total

    @property
    def mtp_bytes(self) -> int:
        """The MTP drafter's SWA ring(s): inference-ring rows of MXFP8, like any SWA ring."""
        return self.mtp_rings * self.inference_ring * self.swa_token_bytes

    @property
    def slot_bytes(self) -> int:
        return self.stored_bytes + self.consumer_swa_bytes + self.compression_bytes + self.mtp_bytes

    def regions(self) -> list[Region]:
        """Every tensor of the slot, in layout order, via the builder (checked by finalize)."""
        b = LayoutBuilder(self)
        cfg = self.cfg
        stored = [i for i in range(cfg.n_layers) if not is_dropped_swa_layer(cfg, i)]
        dropped = [i for i in range(cfg.n_layers) if is_dropped_swa_layer(cfg, i)]
        for layer in stored + dropped:
            b.add("swa", layer, (self.swa_ring, self.swa_token_bytes), "uint8")
        for layer in cfg.compressed_layers:
            r = self.backtrack + cfg.compress_ratio(layer)
            b.add("cmp", layer, (r, 2, cfg.head_dim), "float32")
            if cfg.layers[layer] == "csa":
                b.add("idx", layer, (r, 2, cfg.index_dim), "float32")
        for ring in range(self.mtp_rings):
            b.add("mtp", ring, (self.inference_ring, self.swa_token_bytes), "uint8")
        b.finalize()
        return b.regions


@dataclass
class LayoutBuilder:
    block: StateBlock
    offset: int = 0
    regions: list[Region] = field(default_factory=list)

    def add(self, name: str, layer: int, shape: tuple[int, ...], dtype: str) -> Region:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * (FP32 if dtype == "float32" else 1)
        if dtype == "float32" and self.offset % FP32:
            raise AssertionError(f"{name}[{layer}] at offset {self.offset} is not 4-byte aligned")
        region = Region(name, layer, self.offset, nbytes, shape, dtype)
        self.regions.append(region)
        self.offset += nbytes
        return region

    def finalize(self) -> None:
        """The walked total must equal the closed form; both must agree on the stored cut."""
        if self.offset != self.block.slot_bytes:
            raise AssertionError(
                f"state layout drift: tensors laid out take {self.offset} B, "
                f"StateBlock precomputed {self.block.slot_bytes} B"
            )
        stored_end = sum(r.nbytes for r in self.regions
                         if r.name == "swa" and not is_dropped_swa_layer(self.block.cfg, r.layer))
        if stored_end != self.block.stored_bytes:
            raise AssertionError(f"stored region drift: {stored_end} vs {self.block.stored_bytes}")
