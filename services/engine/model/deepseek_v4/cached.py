"""DeepSeek V4 over a sequence in pieces: what each layer keeps between calls, and `extend`.

`SequenceCache` holds, per layer, the last W - 1 rotated K = V rows (the window the next
tokens still see) and, on CSA / HCA layers, each compressor's state: every entry so far,
the open window's raw projections and (CSA) the last closed window's A series. `extend`
runs the next tokens against it and updates it, so prefill in chunks of any size followed
by one-token decodes computes what the full forward computes over the whole sequence.

This is the model's side of the engine's cached path; the engine's ledgers (MXFP8 rings in
state slots, entries in paged blocks) store the same things.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.services.engine.model.deepseek_v4.attention import AttentionParts
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model


@dataclass
class SequenceCache:
    """One sequence's state; only `extend` changes it."""
    length: int = 0
    layers: list[AttentionParts | None] = field(default_factory=list)


@torch.no_grad()
def extend(model: V4Model, cache: SequenceCache, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Run the next tokens of `cache`'s sequence; logits [len(ids), vocab]."""
    ids = torch.as_tensor(ids, device=model.device).reshape(-1).long()
    if ids.numel() == 0:
        raise ValueError("ids: need at least one token")
    if not cache.layers:
        cache.layers = [None] * model.cfg.num_layers
    positions = torch.arange(cache.length, cache.length + ids.shape[0], device=model.device)
    streams = model.embed(ids)
    keep = model.cfg.window - 1
    for i in range(model.cfg.num_layers):
        streams, parts = model.layer(i, streams, positions, ids, cache.layers[i])
        window = parts.window_kv[max(parts.window_kv.shape[0] - keep, 0):].clone()
        cache.layers[i] = parts._replace(out=None, chosen=None, window_kv=window,
                                         pooled=_drop_new(parts.pooled),
                                         index_pooled=_drop_new(parts.index_pooled))
    cache.length += ids.shape[0]
    return model.head(streams)


def _drop_new(pooled):
    """The state without this call's per-token projections (the open window keeps its own)."""
    return None if pooled is None else pooled._replace(new_kv=None, new_gate=None)
