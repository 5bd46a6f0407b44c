"""The full-sequence forward of DeepSeek V4: no cache, every mask from positions.

This is the oracle the engine's cached path is tested against, as transformers is this
file's. One sequence per call, starting at position 0:

    ids ─ embed ─ n copies ─┬─ layer 0 .. L-1 (hyper-connections around attention and MoE)
                            └─ hc_head collapse ─ norm ─ head ─ logits [S, vocab]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4 import hyper
from kvmesh.services.engine.model.deepseek_v4.attention import AttentionParts, attention
from kvmesh.services.engine.model.deepseek_v4.config import Rope, V4Config
from kvmesh.services.engine.model.deepseek_v4.decode import decode_rows
from kvmesh.services.engine.model.deepseek_v4.moe import moe
from kvmesh.services.engine.model.deepseek_v4.numerics import inv_freq, rms_norm, rope_tables


class RopeTables:
    """cos / sin per RoPE setting, from frequencies computed once (read-only after init)."""

    def __init__(self, cfg: V4Config, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.dtype = dtype
        self._freqs = {rope: inv_freq(rope).to(device) for rope in (cfg.main_rope, cfg.compress_rope)}

    def at(self, rope: Rope, positions: torch.Tensor):
        return rope_tables(rope, positions, self.dtype, self._freqs[rope])


class V4Model:
    """A loaded DeepSeek V4: config, weights (read-only) and RoPE tables.

    stored: compute with what the engine's ledgers keep (window rows in the ring's format
    `rows`, window_rows.py; fp32 compressor state and entries; see `attention`): the oracle
    of the engine's cached path. Off, the forward is the reference's (what `kvmesh score`
    runs and transformers computes).
    """

    def __init__(self, cfg: V4Config, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 stored: bool = False, rows: str = "mxfp8"):
        self.cfg, self.weights, self.dtype, self.stored = cfg, weights, dtype, stored
        self.whole = cfg          # the whole model's config (a split rank computes with less)
        self.rows = rows
        self.device = next(iter(weights.values())).device     # where every tensor is built
        self.tables = RopeTables(cfg, dtype, self.device)
        self.layers = [_sub(weights, f"layers.{i}.") for i in range(cfg.num_layers)]
        self.attn = [_sub(w, "attn.") for w in self.layers]
        self.ffn = [_sub(w, "ffn.") for w in self.layers]

    def layer(self, i: int, streams: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor,
              prior: AttentionParts | None = None) -> tuple[torch.Tensor, AttentionParts]:
        """streams [S, n, D] -> [S, n, D], and what the attention keeps (see `attention`)."""
        streams, (parts,) = self.layer_spans(i, streams, [(positions, prior)], ids)
        return streams, parts

    def layer_spans(self, i: int, streams: torch.Tensor, spans: list, ids: torch.Tensor):
        """Several sequences' tokens in one pass: spans[k] = (positions, prior) or
        (positions, prior, given) of the k-th run of rows, in row order (`given`: see
        `attention`). Everything but attention runs over all rows at once (the MoE's grouped
        products included); attention runs per span, except that spans of one decode row
        each attend together (decode.py)."""
        cfg, w = self.cfg, self.layers[i]
        pre, post, comb = self._mix(streams, w, "hc_attn")
        x = rms_norm(hyper.collapse(streams, pre), w["attn_norm.weight"], cfg.rms_eps)
        bounds, start = [], 0
        for positions, *_ in spans:
            bounds.append((start, start + positions.shape[0]))
            start += positions.shape[0]
        parts: list = [None] * len(spans)
        # spans of one decode row after a prefix attend together (decode.py)
        decoding = [k for k, (positions, prior, *given) in enumerate(spans)
                    if positions.shape[0] == 1 and prior is not None and not any(given)]
        if len(decoding) > 1:
            rows = torch.tensor([bounds[k][0] for k in decoding], device=x.device)
            batch = decode_rows(cfg, i, self.attn[i], x[rows],
                                torch.cat([spans[k][0] for k in decoding]), self.tables,
                                [spans[k][1] for k in decoding], self.stored, self.rows)
            for k, part in zip(decoding, batch, strict=True):
                parts[k] = part
        for k, (positions, prior, *given) in enumerate(spans):
            if parts[k] is None:
                start, end = bounds[k]
                parts[k] = attention(cfg, i, self.attn[i], x[start:end], positions, self.tables,
                                     prior, self.stored, *given, rows=self.rows)
        out = parts[0].out if len(parts) == 1 else torch.cat([p.out for p in parts])
        streams = hyper.expand(streams, self.attention_total(out), post, comb)
        pre, post, comb = self._mix(streams, w, "hc_ffn")
        x = rms_norm(hyper.collapse(streams, pre), w["ffn_norm.weight"], cfg.rms_eps)
        return hyper.expand(streams, self.mlp(i, x, ids), post, comb), parts

    # The three points where a model split over ranks (parallel.py) differs from this one.
    def attention_total(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output of all heads, given this model's heads' share: all of it."""
        return out

    def mlp(self, i: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Layer i's MoE block on x [N, D]."""
        return moe(self.cfg, i, self.ffn[i], x, ids)

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final normed rows [S, D] -> logits [S, vocab]."""
        return F.linear(h, self.weights["head.weight"])

    def _mix(self, streams, w, name):
        return hyper.mix_weights(streams, w[f"{name}_fn"], w[f"{name}_base"], w[f"{name}_scale"],
                                 self.cfg.hc_sinkhorn_iters, self.cfg.hc_eps, self.cfg.rms_eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S] -> the hyper-connection streams [S, n, D]: n copies of the embedding."""
        embedded = F.embedding(ids, self.weights["embed.weight"])
        return embedded.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [S, n, D] -> logits [S, vocab]."""
        cfg, w = self.cfg, self.weights
        h = hyper.head_collapse(streams, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"],
                                cfg.hc_eps, cfg.rms_eps)
        return self.vocab_logits(rms_norm(h, w["norm.weight"], cfg.rms_eps))

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S] -> logits [S, vocab] in the model's dtype."""
        return self.head(self.final_streams(ids))

    @torch.no_grad()
    def final_streams(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S] -> the last layer's streams [S, n, D] (what `head` collapses, and what
        the MTP module reads)."""
        ids = ids.reshape(-1).long().to(self.device)
        positions = torch.arange(ids.shape[0], device=self.device)
        streams = self.embed(ids)
        for i in range(self.cfg.num_layers):
            streams, _ = self.layer(i, streams, positions, ids)
        return streams


def _sub(w: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
