"""DeepSeek V4.1 through the engine's two ledgers: the slot layout sized from the config, and
a sequence's forward that keeps its state in them and nowhere else.

State ledger: one uint8 tensor [slots, slot_bytes]; each region a typed view, in the order
v41_layout.py sizes them (`V41SlotLayout` walks it and insists the two agree):

    | swa[0] .. swa[e-1]  (encoder: stored) | swa[e] .. swa[L-1] (decoder) | tail of each pooling KV source |
      [R, row] uint8: row = position % R                                    [m + 6, 2, d]: a token's raw
                                                                              kv and gate, row = position % (m + 6)

Block ledger: the engine's BlockStore with, per KV source, entries [blocks, 128 / m, d] and
index keys [blocks, 128 / m, c_I]. Tails and blocks are kept in the model's reduction dtype
(fp32, or float64 for a float64 model), so the ledger path computes what v41_forward.py
computes; window rows in the ring's format (window_rows.py: MXFP8, or exact in float64).

`step` runs several sequences' next tokens from these bytes (plus each one's length, block
table and decoder cut) and writes back what they add; `replay` is the encoder-side bounded
replay after a block hit; `ledgers.rollback` takes back rejected drafts by length alone.
"""

from __future__ import annotations

import torch

from kvmesh.services.engine.cache.block_store import BlockStore
from kvmesh.services.engine.cache.state_layout import Region
from kvmesh.services.engine.model.deepseek_v4 import v41_layout, window_rows
from kvmesh.services.engine.model.deepseek_v4.layout import BACKTRACK, BLOCK_TOKENS
from kvmesh.services.engine.model.deepseek_v4.ledgers import LedgerBook, Sequence, check_works
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config
from kvmesh.services.engine.model.deepseek_v4.v41_forward import (
    BATCHED_SPAN,
    LayerState,
    Shared,
    SourceState,
    Span,
    V41Model,
    wide,
)

BLOCK = BLOCK_TOKENS


class V41SlotLayout:
    """Every region of one state slot, walked, and checked against v41_layout's closed form."""

    def __init__(self, cfg: V41Config, extra_state: bool = False, rows: str = "mxfp8",
                 state_dtype: torch.dtype = torch.float32):
        self.cfg, self.rows, self.state_dtype = cfg, rows, state_dtype
        self.ring = v41_layout.ring_rows(cfg, extra_state)
        self.row_bytes = window_rows.row_bytes(rows, cfg.head_dim)
        self.regions: list[Region] = []
        self.slot_bytes = 0
        for i in range(cfg.num_layers):
            self._add("swa", i, (self.ring, self.row_bytes), torch.uint8)
        self.slot_bytes += -self.slot_bytes % state_dtype.itemsize
        for i in cfg.kv_sources:
            if cfg.ratio(i) > 1:
                self._add("tail", i, (cfg.ratio(i) + BACKTRACK, 2, cfg.head_dim), state_dtype)
        closed = v41_layout.report(cfg, extra_state, rows_format=rows,
                                   state_dtype=state_dtype)["state_slot"]["bytes"]
        if self.slot_bytes != closed:
            raise AssertionError(f"state layout drift: the regions take {self.slot_bytes} B, "
                                 f"v41_layout.py computes {closed} B")

    def _add(self, name: str, layer: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        n = 1
        for s in shape:
            n *= s
        self.regions.append(Region(name, layer, self.slot_bytes, n * dtype.itemsize, shape,
                                   str(dtype).removeprefix("torch.")))
        self.slot_bytes += n * dtype.itemsize


class V41BlockGeometry:
    """What the engine's BlockStore reads of a model config, for a DeepSeek V4.1 config: the
    KV sources hold entries and index keys."""

    def __init__(self, cfg: V41Config):
        self.block_size = BLOCK
        self.head_dim, self.index_dim = cfg.head_dim, cfg.index_head_dim
        self.layers = tuple("csa" if i in cfg.kv_sources else "swa" for i in range(cfg.num_layers))
        self.compressed_layers = list(cfg.kv_sources)
        self._ratios = cfg.ratios

    def compress_ratio(self, layer: int) -> int | None:
        return self._ratios[layer] or None


class V41Ledgers(LedgerBook):
    """The slots and blocks of one engine serving DeepSeek V4.1. A held slot's and block's
    bytes are written only by this module's `step` / `replay`; `ledgers.rollback` changes
    nothing but lengths and block tables."""

    def __init__(self, cfg: V41Config, num_slots: int, num_blocks: int, extra_state: bool = False,
                 rows: str = "mxfp8", dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.cfg, self.rows = cfg, rows
        self.state_dtype = wide(dtype)
        self.slot_layout = V41SlotLayout(cfg, extra_state, rows, self.state_dtype)
        self.inference_rows = v41_layout.ring_rows(cfg, extra_state=False)   # a decode engine's
        self.data = torch.zeros(num_slots, self.slot_layout.slot_bytes, dtype=torch.uint8,
                                device=device)
        self.swa: dict[int, torch.Tensor] = {}
        self.tail: dict[int, torch.Tensor] = {}
        for r in self.slot_layout.regions:
            raw = self.data[:, r.offset:r.offset + r.nbytes]
            view = raw if r.dtype == "uint8" else raw.view(self.state_dtype)
            {"swa": self.swa, "tail": self.tail}[r.name][r.layer] = view.view(num_slots, *r.shape)
        self.blocks = BlockStore(V41BlockGeometry(cfg), num_blocks, dtype=self.state_dtype,
                                 device=device)
        super().__init__(num_slots, num_blocks)


@torch.no_grad()
def step(model: V41Model, led: V41Ledgers, works: list[tuple[Sequence, list[int]]],
         decoder_from: list[int | None] | None = None, mode: str = "compact",
         streams_too: bool = False, before: list[list[int]] | None = None):
    """One forward over several sequences' next tokens (decode rows and prefill chunks
    together, one sequence once): per-token work runs over all rows; short spans after a
    prefix (decode rows, verify spans) read their rings, attend and write back together
    (v41_decode.py), other spans one at a time.
    decoder_from[k]: work k's decoder-side cut (prefill truncation: its decoder layers run on
    positions from there on; None: every position). Returns each work's logits [rows, vocab]
    for the rows that went through every layer (all of them without a cut, else the work's
    last ones); with `streams_too`, (logits, those rows' last-layer streams [rows, n, D]:
    what kvmesh's MTP module reads). before[k]: the tokens preceding work k's (at least
    the model's `lookback` of them, fewer only at the start), which an Engram model's
    n-grams read; the ledgers keep no tokens."""
    logits, streams = _run(model, led, works, decoder_from or [None] * len(works), mode, None,
                           before)
    return (logits, streams) if streams_too else logits


@torch.no_grad()
def replay(model: V41Model, led: V41Ledgers, seq: Sequence, prompt: list[int], hit: int,
           decoder_from: int | None = None, mode: str = "compact") -> torch.Tensor:
    """Encoder-side bounded replay (docs/design.md §3): `seq` holds the blocks of the
    prompt's first `hit` tokens (a multiple of 128) and nothing else. Tokens [hit - 128,
    len(prompt)) run with empty windows against the cached entries and keys, which are read,
    never recomputed or overwritten. Returns the logits of the rows that went through every
    layer; the sequence then stands at len(prompt), approximate by design."""
    if seq.length or hit % BLOCK or not 0 < hit < len(prompt) or len(seq.blocks) != hit // BLOCK:
        raise ValueError(f"replay: an empty sequence holding the {hit // BLOCK} blocks of a "
                         f"hit at a positive multiple of {BLOCK} below the prompt's length")
    seq.length = hit - BLOCK
    (logits,), _ = _run(model, led, [(seq, prompt[hit - BLOCK:])], [decoder_from], mode, hit,
                        [prompt[max(hit - BLOCK - lookback(model.cfg), 0):hit - BLOCK]])
    return logits


def lookback(cfg: V41Config) -> int:
    """How many tokens before a chunk its forward reads: Engram's longest n-gram's reach."""
    return cfg.engram.max_ngram - 1 if cfg.engram is not None else 0


def _run(model: V41Model, led: V41Ledgers, works, cuts: list[int | None], mode: str,
         replay_hit: int | None, before: list[list[int]] | None,
         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`step` (logits and streams); with `replay_hit`, the one work is a replay from that
    block hit."""
    _check(model, led)
    cfg = model.cfg
    seqs, chunks = check_works(works, model.device)
    if len(cuts) != len(works):
        raise ValueError("decoder_from: one entry per work")
    if any(c is not None for c in cuts) and cfg.decoder_start is None:
        raise ValueError("decoder_from: the model has no decoder layers")
    if mode not in ("compact", "mask"):
        raise ValueError(f"mode {mode!r}: expected compact or mask")
    positions = [torch.arange(s.length, s.length + c.shape[0], device=model.device)
                 for s, c in zip(seqs, chunks, strict=True)]
    for seq, pos in zip(seqs, positions, strict=True):
        led._reserve(seq, int(pos[-1]) + 1)
    streams, pre = model.embed(torch.cat(chunks))
    if model.hasher is not None and (before is None or len(before) != len(works)):
        raise ValueError("before: an Engram model needs the tokens preceding each work")
    grams = [model.grams(c, b) for c, b in zip(chunks, before, strict=True)] \
        if model.hasher is not None and before is not None else [None] * len(works)
    shared = [Shared() for _ in works]
    for i in range(cfg.num_layers):
        spans, live = [], []
        for k, pos in enumerate(positions):
            if pos.numel() == 0:          # every row dropped at the decoder's cut
                continue
            cut = cuts[k]
            floor = cut if cut is not None and i >= cfg.decoder_start else 0
            rows = pos >= cut if floor and mode == "compact" and i == cfg.decoder_start else None
            spans.append(Span(pos, shared[k], None, floor, rows, grams[k]))
            live.append(k)
        if not spans:
            break
        # short spans after a prefix (decode rows, verify spans; no cut here) read and write
        # their rings together, and attend together
        decoding = [j for j, (k, span) in enumerate(zip(live, spans, strict=True))
                    if span.positions.numel() <= BATCHED_SPAN and span.rows is None
                    and seqs[k].length and replay_hit is None]
        batched = len(decoding) > 1
        if not batched:
            decoding = []
        priors = _read_rows(model, led, [seqs[live[j]] for j in decoding], i,
                            [spans[j].floor for j in decoding]) if batched else []
        for j, prior in zip(decoding, priors, strict=True):
            spans[j] = spans[j]._replace(prior=prior)
        for j, (k, span) in enumerate(zip(live, spans, strict=True)):
            if span.prior is None and (seqs[k].length or replay_hit is not None):
                spans[j] = span._replace(prior=_read(model, led, seqs[k], i, span.floor,
                                                     replay_hit))
        streams, pre, results = model.layer_spans(i, streams, pre, spans)
        for j, (k, span, (shared_out, state)) in enumerate(zip(live, spans, results, strict=True)):
            kept = span.positions if span.rows is None else span.positions[span.rows]
            if j not in decoding:
                _write(led, seqs[k], i, span.positions, kept, state, replay_hit)
            shared[k] = shared_out
            positions[k] = kept
            if span.rows is not None and grams[k] is not None:
                grams[k] = grams[k][span.rows]
        if batched:
            _write_rows(led, [seqs[live[j]] for j in decoding], i,
                        [spans[j].positions for j in decoding],
                        [results[j][1] for j in decoding])
    for seq, chunk in zip(seqs, chunks, strict=True):
        seq.length += chunk.shape[0]
    sizes = [pos.shape[0] for pos in positions]
    if streams.shape[0] == 0:
        return [streams.new_zeros((0, cfg.vocab_size)) for _ in sizes], list(streams.split(sizes))
    return list(model.head(streams, pre).split(sizes)), list(streams.split(sizes))


def _check(model: V41Model, led: V41Ledgers) -> None:
    if wide(model.dtype) != led.state_dtype:
        raise ValueError(f"the ledgers keep {led.state_dtype} state, the model computes in "
                         f"{model.dtype}")
    if led.rows == "mxfp8" and model.rows != led.rows:
        raise ValueError(f"the ledgers keep {led.rows} window rows: the model must round its "
                         f"fresh rows the same way (V41Model(..., rows={led.rows!r})), else a "
                         "row's result depends on how its prompt was chunked")


def _read(model: V41Model, led: V41Ledgers, seq: Sequence, layer: int, floor: int,
          replay_hit: int | None) -> LayerState:
    """A layer's state after `seq.length` tokens, from the ring, tail and blocks. A replay
    reads no window rows and every entry through its hit."""
    cfg, end = model.cfg, seq.length
    first = end if replay_hit is not None else min(max(end - (cfg.window - 1), floor, 0), end)
    ring = led.swa[layer][seq.slot]
    window = window_rows.decode(led.rows, ring[torch.arange(first, end, device=ring.device) % ring.shape[0]],
                                model.dtype)
    return LayerState(window, _source(model, led, seq, layer, replay_hit))


def _source(model: V41Model, led: V41Ledgers, seq: Sequence, layer: int,
            replay_hit: int | None) -> SourceState | None:
    """A KV source's compressor state after `seq.length` tokens (through a replay's hit):
    its entries and keys from the blocks, its open group from the tail."""
    cfg, end = model.cfg, seq.length
    if layer not in cfg.kv_sources:
        return None
    m = cfg.ratio(layer)
    n = (replay_hit if replay_hit is not None else end) // m
    entries = led.blocks.gather(seq.blocks, layer, n).to(model.dtype)
    keys = led.blocks.gather(seq.blocks, layer, n, keys=True).to(model.dtype)
    if m > 1 and replay_hit is None:
        tail = led.tail[layer][seq.slot]
        open_rows = tail[torch.arange(n * m, end, device=tail.device) % tail.shape[0]]
    else:
        open_rows = torch.zeros(0, 2, cfg.head_dim, dtype=led.state_dtype, device=entries.device)
    return SourceState(layer, entries, keys, open_rows[:, 0], open_rows[:, 1])


def _read_rows(model: V41Model, led: V41Ledgers, seqs: list[Sequence], layer: int,
               floors: list[int]) -> list[LayerState]:
    """`_read` for several sequences at once (decode rows): every ring's window rows in one
    gather and one decode. Shorter windows gather rows past their own, cut off unread."""
    cfg, ring = model.cfg, led.swa[layer]
    ends = torch.tensor([s.length for s in seqs], device=ring.device)
    firsts = torch.minimum(torch.clamp(torch.maximum(ends - (cfg.window - 1),
                                                     torch.tensor(floors, device=ring.device)),
                                       min=0), ends)
    counts = (ends - firsts).tolist()
    at = (firsts.view(-1, 1) + torch.arange(max(counts), device=ring.device)) % ring.shape[1]
    slots = torch.tensor([s.slot for s in seqs], device=ring.device).view(-1, 1)
    windows = window_rows.decode(led.rows, ring[slots, at], model.dtype)       # [B, K, d]
    return [LayerState(windows[b, :n], _source(model, led, seq, layer, None))
            for b, (seq, n) in enumerate(zip(seqs, counts, strict=True))]


def _write_rows(led: V41Ledgers, seqs: list[Sequence], layer: int,
                positions: list[torch.Tensor], states: list[LayerState]) -> None:
    """`_write` for several sequences' short spans after their prefix (positions[b]: its
    rows'; at most BATCHED_SPAN, so fewer than a ring or tail holds): the window rows and the
    tails' rows in one scatter each; entries where a row closed a group."""
    ring = led.swa[layer]
    counts = torch.tensor([p.shape[0] for p in positions], device=ring.device)
    slots = torch.repeat_interleave(torch.tensor([s.slot for s in seqs], device=ring.device),
                                    counts)
    at_pos = torch.cat(positions)
    rows = torch.cat([state.window[-p.shape[0]:] for state, p in zip(states, positions,
                                                                      strict=True)])
    ring[slots, at_pos % ring.shape[1]] = window_rows.encode(led.rows, rows)
    if states[0].source is None:
        return
    m = led.cfg.ratio(layer)
    if m > 1:
        tail = led.tail[layer]
        at = at_pos % tail.shape[1]
        tail[slots, at, 0] = torch.cat([st.source.new_kv[-p.shape[0]:] for st, p
                                        in zip(states, positions, strict=True)]).to(tail.dtype)
        tail[slots, at, 1] = torch.cat([st.source.new_gate[-p.shape[0]:] for st, p
                                        in zip(states, positions, strict=True)]).to(tail.dtype)
    for seq, state in zip(seqs, states, strict=True):
        old = seq.length // m
        if state.source.entries.shape[0] > old:
            led.blocks.scatter(seq.blocks, layer, old, state.source.entries[old:])
            led.blocks.scatter(seq.blocks, layer, old, state.source.keys[old:], keys=True)


def _write(led: V41Ledgers, seq: Sequence, layer: int, positions: torch.Tensor,
           kept: torch.Tensor, state: LayerState, replay_hit: int | None) -> None:
    """Store what a span adds: the window rows of the positions attention ran on (`kept`),
    and on a KV source the raw projections of the rows it compressed (the span's last ones)
    and the entries and keys they completed."""
    ring = led.swa[layer][seq.slot]
    new = min(kept.shape[0], ring.shape[0])
    if new:
        ring[kept[-new:] % ring.shape[0]] = window_rows.encode(led.rows, state.window[-new:])
    source = state.source
    if source is None:
        return
    m = led.cfg.ratio(layer)
    if m > 1 and source.new_kv is not None and source.new_kv.shape[0]:
        tail = led.tail[layer][seq.slot]
        keep = min(source.new_kv.shape[0], tail.shape[0])
        at = positions[-keep:] % tail.shape[0]
        tail[at, 0] = source.new_kv[-keep:].to(tail.dtype)
        tail[at, 1] = source.new_gate[-keep:].to(tail.dtype)
    old = (replay_hit if replay_hit is not None else seq.length) // m
    led.blocks.scatter(seq.blocks, layer, old, source.entries[old:])
    led.blocks.scatter(seq.blocks, layer, old, source.keys[old:], keys=True)
