"""DeepSeek V4 through the engine's two ledgers: the byte layout sized from the config, and
a sequence's forward that keeps its state in them and nowhere else.

State ledger: one uint8 tensor [slots, slot_bytes]; each region a typed view, laid out as
`layout.py` sizes it (`SlotLayout` walks it and insists the two agree):

    | swa[0] | swa[1] | ... | swa[L-1] | cmp / idx of each CSA and HCA layer, in layer order |
      [R, 528] uint8 rows: MXFP8 K = V,     [rows, 2, width] fp32: a token's raw projections
      row = position % R                    (kv, then gate), row = position % rows

    R = W + 6 (396 with --extra-state); rows = m + 6 (HCA, width c), 2m + 6 (CSA, width 2c:
    the last closed window's A series is re-read from it), the indexer's at width 2 c_I.

Block ledger: the engine's BlockStore (services/engine/cache/block_store.py) over this
config: per compressed layer, entries [blocks, 128 / m, d] fp32 and, for CSA, the indexer's
keys [blocks, 32, c_I] fp32. Entry j of a sequence is row (j m mod 128) / m of block
table[j m // 128]; a sequence holds ceil(length / 128) blocks.

`extend` / `step` run sequences' next tokens reading only these bytes (plus each one's
length and block table) and write back what the tokens add; `replay` is the bounded replay
from a block hit, `rollback` takes back rejected drafts. The model is built with
`stored=True`, so its numbers are those of the full forward with the same roundings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.services.engine.cache.block_pool import BlockPool
from kvmesh.services.engine.cache.block_store import BlockStore
from kvmesh.services.engine.cache.state_layout import Region
from kvmesh.services.engine.model.deepseek_v4 import layout, window_rows
from kvmesh.services.engine.model.deepseek_v4.attention import AttentionParts
from kvmesh.services.engine.model.deepseek_v4.compressor import Pooled
from kvmesh.services.engine.model.deepseek_v4.config import CSA, SLIDING, V4Config
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model

FP32 = 4
BLOCK = layout.BLOCK_TOKENS


class SlotLayout:
    """Every region of one state slot, walked, and checked against layout.py's closed form."""

    def __init__(self, cfg: V4Config, extra_state: bool = False, rows: str = "mxfp8"):
        self.cfg, self.rows = cfg, rows
        self.ring = layout.ring_rows(cfg, extra_state)
        self.row_bytes = layout.row_bytes(cfg, rows)
        self.regions: list[Region] = []
        self.slot_bytes = 0
        for i in range(cfg.num_layers):
            self._add("swa", i, (self.ring, self.row_bytes), "uint8")
        self.slot_bytes += -self.slot_bytes % FP32   # rows of odd sizes (tiny configs) pad here
        for i, kind in enumerate(cfg.layer_kinds):
            if kind == SLIDING:
                continue
            self._add("cmp", i, (self.tail_rows(kind), 2, self._width(kind, cfg.head_dim)),
                      "float32")
            if kind == CSA:
                self._add("idx", i, (self.tail_rows(kind), 2, 2 * cfg.index_head_dim), "float32")
        closed = layout.report(cfg, extra_state, rows_format=rows)["state_slot"]["bytes"]
        if self.slot_bytes != closed:
            raise AssertionError(f"state layout drift: the regions take {self.slot_bytes} B, "
                                 f"layout.py computes {closed} B")

    def tail_rows(self, kind: str) -> int:
        m = self.cfg.csa_rate if kind == CSA else self.cfg.hca_rate
        return (2 * m if kind == CSA else m) + layout.BACKTRACK

    @staticmethod
    def _width(kind: str, dim: int) -> int:
        return 2 * dim if kind == CSA else dim

    def _add(self, name: str, layer: int, shape: tuple[int, ...], dtype: str) -> None:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * (FP32 if dtype == "float32" else 1)
        if dtype == "float32" and self.slot_bytes % FP32:
            raise AssertionError(f"{name}[{layer}] at offset {self.slot_bytes} is not 4-byte aligned")
        self.regions.append(Region(name, layer, self.slot_bytes, nbytes, shape, dtype))
        self.slot_bytes += nbytes


class BlockGeometry:
    """What the engine's BlockStore reads of a model config, for a DeepSeek V4 config."""

    def __init__(self, cfg: V4Config):
        self.block_size = BLOCK
        self.head_dim, self.index_dim = cfg.head_dim, cfg.index_head_dim
        self.layers = tuple("swa" if kind == SLIDING else kind for kind in cfg.layer_kinds)
        self.compressed_layers = [i for i, kind in enumerate(cfg.layer_kinds) if kind != SLIDING]
        self._rates = [cfg.rate(i) for i in range(cfg.num_layers)]

    def compress_ratio(self, layer: int) -> int | None:
        return self._rates[layer] or None


class LedgerBook:
    """The bookkeeping both models' ledgers share: the free state slots, the block pool (ids,
    reference counts, the free queue) and each sequence's block table. Subclasses own the
    bytes (`blocks`: a BlockStore)."""

    def __init__(self, num_slots: int, num_blocks: int):
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.pool = BlockPool(num_blocks)  # block ids, reference counts, the free queue

    def block_bytes(self) -> int:
        return self.blocks.payload_bytes()

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def open(self) -> Sequence:
        if not self._free_slots:
            raise RuntimeError("no free state slot")
        return Sequence(self._free_slots.pop())

    def close(self, seq: Sequence) -> None:
        self._free_slots.append(seq.slot)
        self.pool.release(reversed(seq.blocks))
        seq.blocks = []

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Start `seq` (empty) on another sequence's complete blocks: a prefix hit."""
        if seq.length or seq.blocks:
            raise ValueError("share: the sequence must be empty")
        for b in blocks:
            self.pool.acquire(b)
        seq.blocks = list(blocks)

    def take_blocks(self, n: int) -> list[int]:
        """n fresh blocks (one reference each), e.g. to install blocks fetched by bytes."""
        return self.pool.allocate(n)

    def _reserve(self, seq: Sequence, length: int) -> None:
        need = -(-length // BLOCK) - len(seq.blocks)
        if need > 0:
            seq.blocks += self.take_blocks(need)


class Ledgers(LedgerBook):
    """The slots and blocks of one engine. Owns the bytes, both free lists and the blocks'
    reference counts. A held slot's and block's bytes are written only by this module's
    `step` / `extend` / `replay` and by snapshots.py's `restore`, `install_blocks` and
    `hand_off`; `rollback` changes nothing but lengths and block tables."""

    def __init__(self, cfg: V4Config, num_slots: int, num_blocks: int, extra_state: bool = False,
                 rows: str = "mxfp8", device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.slot_layout = SlotLayout(cfg, extra_state, rows)
        self.rows = rows                   # the rings' row format (window_rows.py)
        self.inference_rows = layout.ring_rows(cfg, extra_state=False)   # a decode engine's
        self.data = torch.zeros(num_slots, self.slot_layout.slot_bytes, dtype=torch.uint8,
                                device=device)
        self.swa: dict[int, torch.Tensor] = {}
        self.cmp: dict[int, torch.Tensor] = {}
        self.idx: dict[int, torch.Tensor] = {}
        for r in self.slot_layout.regions:
            raw = self.data[:, r.offset:r.offset + r.nbytes]
            view = (raw.view(torch.float32) if r.dtype == "float32" else raw).view(num_slots, *r.shape)
            {"swa": self.swa, "cmp": self.cmp, "idx": self.idx}[r.name][r.layer] = view
        # the engine's block store (its serialized form is what the kvstore keeps)
        self.blocks = BlockStore(BlockGeometry(cfg), num_blocks, device=device)
        self.entries: dict[int, torch.Tensor] = self.blocks.entries
        self.keys: dict[int, torch.Tensor] = self.blocks.index_keys
        super().__init__(num_slots, num_blocks)


@dataclass
class Sequence:
    """What the engine knows of a sequence besides its ledger bytes."""
    slot: int
    blocks: list[int] = field(default_factory=list)   # block table
    length: int = 0


@torch.no_grad()
def extend(model: V4Model, led: Ledgers, seq: Sequence, ids) -> torch.Tensor:
    """Run the sequence's next tokens from its ledger state; logits [len(ids), vocab]."""
    return step(model, led, [(seq, ids)])[0]


@torch.no_grad()
def step(model: V4Model, led: Ledgers, works: list[tuple[Sequence, list[int]]],
         streams_too: bool = False):
    """One forward over several sequences' next tokens (decode rows and prefill chunks
    together, one sequence once): per-token work runs over all rows; decode rows read and
    write their rings and attend together (decode.py), other spans one at a time.
    Returns each work's logits [len(ids), vocab]; with `streams_too`, (logits, the last
    layer's streams [len(ids), n, D] of each work: what the MTP module reads)."""
    _check_model(model, led)
    seqs, chunks = check_works(works, model.device)
    positions = [torch.arange(s.length, s.length + c.shape[0], device=model.device)
                 for s, c in zip(seqs, chunks, strict=True)]
    for seq, pos in zip(seqs, positions, strict=True):
        led._reserve(seq, int(pos[-1]) + 1)
    ids = torch.cat(chunks)
    streams = model.embed(ids)
    # decode rows (one token after a prefix) read and write their rings together
    decoding = [k for k, (seq, pos) in enumerate(zip(seqs, positions, strict=True))
                if pos.numel() == 1 and seq.length]
    if len(decoding) < 2:
        decoding = []
    for i in range(model.cfg.num_layers):
        priors = dict(zip(decoding, _read_rows(model, led, [seqs[k] for k in decoding], i),
                          strict=True)) if decoding else {}
        spans = [(pos, priors[k] if k in priors else
                  _read(model, led, seq, i) if seq.length else None)
                 for k, (seq, pos) in enumerate(zip(seqs, positions, strict=True))]
        streams, parts = model.layer_spans(i, streams, spans, ids)
        for k, (seq, pos, p) in enumerate(zip(seqs, positions, parts, strict=True)):
            if k not in priors:
                _write(model, led, seq, i, pos, p)
        if decoding:
            _write_rows(model, led, [seqs[k] for k in decoding], i,
                        torch.cat([positions[k] for k in decoding]), [parts[k] for k in decoding])
    for seq, chunk in zip(seqs, chunks, strict=True):
        seq.length += chunk.shape[0]
    sizes = [c.shape[0] for c in chunks]
    logits = list(model.head(streams).split(sizes))
    return (logits, list(streams.split(sizes))) if streams_too else logits


def check_works(works, device: torch.device | str = "cpu") -> tuple[list[Sequence], list[torch.Tensor]]:
    """A step's (sequence, ids) works, checked: each has tokens, no sequence twice. Returns
    the sequences and each one's ids as a long tensor on `device`."""
    chunks = [torch.as_tensor(ids, device=device).reshape(-1).long() for _, ids in works]
    for k, chunk in enumerate(chunks):
        if chunk.numel() == 0:
            raise ValueError(f"works[{k}].ids: need at least one token")
    seqs = [seq for seq, _ in works]
    if len({id(s) for s in seqs}) != len(seqs):
        raise ValueError("works: a sequence appears twice in one step")
    return seqs, chunks


@torch.no_grad()
def replay(model: V4Model, led: Ledgers, seq: Sequence, prompt: list[int], hit: int) -> torch.Tensor:
    """Bounded replay (docs/design.md §6): `seq` holds the blocks of the prompt's first `hit`
    tokens (a multiple of 128) and nothing else. Tokens [hit - 128, len(prompt)) run as a
    fresh window (each query sees keys from hit - 128 on) against the cached entries, which
    are read, never recomputed or overwritten; the CSA overlap at `hit` comes from the
    replayed rows. The cost does not grow with the prefix. Returns the logits of the
    replayed rows; the sequence then stands at len(prompt), approximate by design."""
    _check_model(model, led)
    if seq.length or hit % BLOCK or not 0 < hit < len(prompt) or len(seq.blocks) != hit // BLOCK:
        raise ValueError(f"replay: an empty sequence holding the {hit // BLOCK} blocks of a "
                         f"hit at a positive multiple of {BLOCK} below the prompt's length")
    start = hit - BLOCK
    ids = torch.as_tensor(prompt[start:], device=model.device).long()
    positions = torch.arange(start, len(prompt), device=model.device)
    led._reserve(seq, len(prompt))
    seq.length = start
    streams = model.embed(ids)
    for i in range(model.cfg.num_layers):
        prior = _cached_only(model, led, seq, i, hit)
        streams, (parts,) = model.layer_spans(i, streams, [(positions, prior, hit - start)], ids)
        _write(model, led, seq, i, positions, parts, entries_from=hit)
    seq.length = len(prompt)
    return model.head(streams)


def rollback(led: Ledgers, seq: Sequence, length: int) -> None:
    """Take back the last tokens of `seq` (rejected drafts), at most BACKTRACK of them.

    Nothing is erased: every reader goes by the sequence's length. The rings keep W + 6 rows
    and the tails their 6 spare rows, so the window, open window and CSA overlap at the new
    end are all still there; entries of windows the rejected tokens closed lie beyond the
    new end and are overwritten when real tokens close those windows again. Blocks past the
    new end go back to the pool."""
    if not seq.length - layout.BACKTRACK <= length <= seq.length or length < 0:
        raise ValueError(f"rollback to {length}: only the last {layout.BACKTRACK} of "
                         f"{seq.length} tokens can be taken back")
    keep = -(-length // BLOCK)
    led.pool.release(reversed(seq.blocks[keep:]))
    del seq.blocks[keep:]
    seq.length = length


def _check_model(model: V4Model, led: Ledgers) -> None:
    if not model.stored or model.rows != led.rows:
        raise ValueError(f"the ledger path needs a model built with stored=True and "
                         f"rows={led.rows!r}, the rings' format")


def _cached_only(model: V4Model, led: Ledgers, seq: Sequence, layer: int, hit: int):
    """A layer's prior for a replay: no window rows, the cached entries before `hit` (the
    replay rebuilds the CSA overlap itself: `compressor.pool(given=...)`)."""
    return _prior(model, led, seq, layer, hit,
                  torch.zeros(0, model.cfg.head_dim, dtype=model.dtype, device=model.device),
                  overlap=False)


def _read(model: V4Model, led: Ledgers, seq: Sequence, layer: int) -> AttentionParts:
    cfg, end = model.cfg, seq.length
    ring = led.swa[layer][seq.slot]
    window_pos = torch.arange(max(0, end - (cfg.window - 1)), end, device=ring.device)
    window = window_rows.decode(led.rows, ring[window_pos % ring.shape[0]], model.dtype)
    return _prior(model, led, seq, layer, end, window, overlap=True)


def _read_rows(model: V4Model, led: Ledgers, seqs: list[Sequence], layer: int
               ) -> list[AttentionParts]:
    """`_read` for several sequences at once (decode rows): every ring's window rows in one
    gather and one decode. Shorter windows gather rows past their own, cut off unread."""
    ring = led.swa[layer]
    ends = torch.tensor([s.length for s in seqs], device=ring.device)
    firsts = torch.clamp(ends - (model.cfg.window - 1), min=0)
    counts = (ends - firsts).tolist()
    at = (firsts.view(-1, 1) + torch.arange(max(counts), device=ring.device)) % ring.shape[1]
    slots = torch.tensor([s.slot for s in seqs], device=ring.device).view(-1, 1)
    windows = window_rows.decode(led.rows, ring[slots, at], model.dtype)
    return [_prior(model, led, seq, layer, seq.length, windows[b, :n], overlap=True)
            for b, (seq, n) in enumerate(zip(seqs, counts, strict=True))]


def _write_rows(model: V4Model, led: Ledgers, seqs: list[Sequence], layer: int,
                positions: torch.Tensor, parts: list[AttentionParts]) -> None:
    """`_write` for several sequences' single decode rows (positions [B]): the window rows in
    one scatter, then each one's compressors."""
    ring = led.swa[layer]
    slots = torch.tensor([s.slot for s in seqs], device=ring.device)
    rows = torch.stack([p.window_kv[-1] for p in parts])
    ring[slots, positions % ring.shape[1]] = window_rows.encode(led.rows, rows)
    if parts[0].pooled is None:
        return
    for b, (seq, p) in enumerate(zip(seqs, parts, strict=True)):
        _write_compressor(led, seq, layer, False, positions[b:b + 1], p.pooled, 0)
        if p.index_pooled is not None:
            _write_compressor(led, seq, layer, True, positions[b:b + 1], p.index_pooled, 0)


def _prior(model: V4Model, led: Ledgers, seq: Sequence, layer: int, length: int,
           window: torch.Tensor, overlap: bool) -> AttentionParts:
    kind = model.cfg.layer_kinds[layer]
    pooled = index_pooled = None
    if kind != SLIDING:
        ape = model.attn[layer]
        pooled = _pooled(led, seq, layer, False, length, kind == CSA and overlap,
                         ape["compressor.ape"], model.dtype)
        if kind == CSA:
            index_pooled = _pooled(led, seq, layer, True, length, overlap,
                                   ape["indexer.compressor.ape"], model.dtype)
    return AttentionParts(None, window, pooled, index_pooled, None)


def _pooled(led: Ledgers, seq: Sequence, layer: int, index: bool, length: int, overlap: bool,
            ape: torch.Tensor, dtype: torch.dtype) -> Pooled:
    """A compressor's state after `length` tokens, from its blocks and its tail ring."""
    tail = (led.idx if index else led.cmp)[layer][seq.slot]
    rate = led.cfg.rate(layer)
    n = length // rate
    entries = led.blocks.gather(seq.blocks, layer, n, keys=index).to(dtype)
    open_rows = tail[torch.arange(n * rate, length, device=tail.device) % tail.shape[0]].to(dtype)
    overlap_kv = overlap_gate = None
    if overlap and n:
        half = tail.shape[-1] // 2
        last = tail[torch.arange((n - 1) * rate, n * rate, device=tail.device) % tail.shape[0]]
        last = last.to(dtype)
        overlap_kv, overlap_gate = last[:, 0, :half], last[:, 1, :half] + ape[:, :half]
    return Pooled(entries, open_rows[:, 0], open_rows[:, 1], overlap_kv, overlap_gate)


def _write(model: V4Model, led: Ledgers, seq: Sequence, layer: int, positions: torch.Tensor,
           parts: AttentionParts, entries_from: int = 0) -> None:
    """Store what the rows at `positions` add; entries before token `entries_from` are
    cached ones (a replay's) and stay as they are."""
    ring = led.swa[layer][seq.slot]
    keep = min(positions.shape[0], ring.shape[0])   # a chunk longer than the ring keeps its end
    ring[positions[-keep:] % ring.shape[0]] = window_rows.encode(led.rows, parts.window_kv[-keep:])
    if parts.pooled is None:
        return
    _write_compressor(led, seq, layer, False, positions, parts.pooled, entries_from)
    if parts.index_pooled is not None:
        _write_compressor(led, seq, layer, True, positions, parts.index_pooled, entries_from)


def _write_compressor(led: Ledgers, seq: Sequence, layer: int, index: bool,
                      positions: torch.Tensor, pooled: Pooled, entries_from: int) -> None:
    tail = (led.idx if index else led.cmp)[layer][seq.slot]
    keep = min(positions.shape[0], tail.shape[0])
    rows = positions[-keep:] % tail.shape[0]
    tail[rows, 0] = pooled.new_kv[-keep:].float()
    tail[rows, 1] = pooled.new_gate[-keep:].float()
    rate = led.cfg.rate(layer)
    old = max(seq.length, entries_from) // rate
    new = (seq.length + positions.shape[0]) // rate
    led.blocks.scatter(seq.blocks, layer, old, pooled.entries[old:new], keys=index)
