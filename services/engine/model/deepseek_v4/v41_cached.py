"""DeepSeek V4.1 over a sequence in pieces: what each layer keeps between calls, and `extend`.

`SequenceState` holds, per layer, the last W - 1 rotated K = V rows (the window the next tokens
still see) and, on KV sources, the compressor's state: every entry and index key so far and
the raw projections of the open group. Consumers keep nothing else: they read their source's
entries through the stack, as in the whole-sequence forward. `extend` runs the next tokens
against the state and updates it, so prefill in chunks of any size followed by one-token
decodes computes what `V41Model.logits` computes over the whole sequence.

Decoder-side truncation (`decoder_from`): the decoder layers (from the last KV source on) run
only on positions at or past it. `compact` drops a chunk's earlier rows in the first decoder
layer once its compressor has run on them (the later layers never see them), `mask` runs
them but keeps every window row below it out of attention.
Either way the logits returned are those of the rows that went through every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config
from kvmesh.services.engine.model.deepseek_v4.v41_forward import LayerState, Shared, V41Model


@dataclass
class SequenceState:
    """One sequence's state; only `extend` changes it."""
    length: int = 0
    layers: list[LayerState | None] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)    # what Engram's n-grams read back into


@torch.no_grad()
def extend(model: V41Model, state: SequenceState, ids: list[int] | torch.Tensor,
           decoder_from: int | None = None, mode: str = "compact") -> torch.Tensor:
    """Run the next tokens of `state`'s sequence; logits [rows, vocab] of the rows that went
    through every layer (all of them without truncation)."""
    cfg = model.cfg
    ids = torch.as_tensor(ids, device=model.device).reshape(-1).long()
    if ids.numel() == 0:
        raise ValueError("ids: need at least one token")
    if decoder_from is not None and cfg.decoder_start is None:
        raise ValueError("decoder_from: the model has no decoder layers (none follows a KV source)")
    if mode not in ("compact", "mask"):
        raise ValueError(f"mode {mode!r}: expected compact or mask")
    if not state.layers:
        state.layers = [None] * cfg.num_layers
    positions = torch.arange(state.length, state.length + ids.shape[0], device=model.device)
    streams, pre = model.embed(ids)
    grams = model.grams(ids, state.tokens)
    shared = Shared()
    keep_rows = cfg.window - 1
    floor = decoder_from or 0
    for i in range(cfg.num_layers):
        decoder = decoder_from is not None and i >= cfg.decoder_start
        rows = positions >= floor if decoder and mode == "compact" and i == cfg.decoder_start \
            else None
        streams, pre, shared, kept = model.layer(i, streams, pre, positions, shared,
                                                 state.layers[i], floor if decoder else 0, rows,
                                                 grams)
        window = kept.window[max(kept.window.shape[0] - keep_rows, 0):].clone()
        state.layers[i] = kept._replace(window=window)
        if rows is not None:
            positions = positions[rows]
            grams = None if grams is None else grams[rows]
        if positions.numel() == 0:   # the chunk lies before the decoder's first position
            break
    state.length += ids.shape[0]
    state.tokens += ids.tolist()
    if positions.numel() == 0:
        return streams.new_zeros((0, cfg.vocab_size))
    return model.head(streams, pre)


def replay_state(cfg: V41Config, exact: SequenceState, hit: int, replay: int = 128) -> SequenceState:
    """The state a bounded replay starts from after a block hit at `hit`: every KV source's
    entries and keys through `hit` (what the blocks hold; `hit` ends a group, so no open
    tokens), no window rows, and the length `hit - replay`: the next `replay` tokens are run
    again to rebuild the windows, their entries taken from the cache, not recomputed.
    `exact`: a state that has run at least `hit` tokens (its entries are the blocks')."""
    if exact.length < hit or hit < replay:
        raise ValueError(f"hit {hit}: need {replay} <= hit <= the state's length {exact.length}")
    layers = []
    for kept in exact.layers:
        source = kept.source
        if source is not None:
            ratio = cfg.ratio(source.layer)
            if hit % ratio:
                raise ValueError(f"hit {hit} does not end a group of {ratio} tokens")
            groups = hit // ratio
            source = source._replace(entries=source.entries[:groups], keys=source.keys[:groups],
                                     open_kv=source.open_kv[:0], open_gate=source.open_gate[:0])
        layers.append(LayerState(kept.window[:0], source))
    return SequenceState(hit - replay, layers, exact.tokens[:hit - replay])
