"""DeepSeek V4.1's lightning indexer and its two-level top-k, over rows of any sequences:
the index queries and head weights, the scores against a KV source's index keys, the
candidate source's first level (its best blocks), and the per-query choice of entries.
v41_forward.py's attention calls these; the batched decode path (v41_decode.py) too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.forward import RopeTables
from kvmesh.services.engine.model.deepseek_v4.numerics import apply_rope, wide
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config


def index_query(cfg: V41Config, w: dict, x: torch.Tensor, q_res: torch.Tensor,
                positions: torch.Tensor, tables: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's rotated queries [S, H_I, c_I] and head weights [S, H_I] (at least fp32),
    weights_proj(x) / sqrt(c_I H_I). w: the layer's weights under `attn.indexer.`."""
    heads, dim = cfg.index_heads, cfg.index_head_dim
    q = F.linear(q_res, w["wq_b.weight"]).view(x.shape[0], heads, dim)
    cos, sin = tables.at(cfg.compress_rope, positions)
    work = wide(x.dtype)
    head_weights = F.linear(x, w["weights_proj.weight"]).to(work) * (dim * heads) ** -0.5
    return apply_rope(q, cos, sin).to(work), head_weights


def index_scores(query: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
    """[S, T]: sum_h weight[i, h] * relu(q[i, h] . key[t]) for `index_query`'s (q, weight)."""
    q, head_weights = query
    scores = F.relu(torch.matmul(q, keys.transpose(-1, -2).to(q.dtype)))        # [S, H_I, T]
    return (scores * head_weights.unsqueeze(-1)).sum(dim=1)


def candidate_blocks(scores: torch.Tensor, seen: torch.Tensor, topk_blocks: int,
                     block_size: int) -> torch.Tensor:
    """The first level of V4.1's two-level top-k: [S, T] bool, the entries of each query's
    best `topk_blocks` blocks of `block_size` (a block scores its best visible entry; the
    block holding the newest visible entry is always kept, as it is only partly filled)."""
    s, t = scores.shape
    nblocks = -(-t // block_size)
    padded = torch.full((s, nblocks * block_size), float("-inf"), dtype=scores.dtype,
                        device=scores.device)
    padded[:, :t] = scores.masked_fill(~seen, float("-inf"))
    block_best = padded.view(s, nblocks, block_size).amax(dim=-1)
    newest = (seen.sum(dim=-1) - 1).div(block_size, rounding_mode="floor")     # -1: none seen
    pinned = torch.arange(nblocks, device=scores.device).view(1, -1) == newest.view(-1, 1)
    block_best = block_best.masked_fill(pinned, float("inf"))
    values, indices = top(block_best, topk_blocks)
    keep = torch.zeros(s, nblocks, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, indices, values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=1)[:, :t] & seen


def top(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of each row, ties to the earlier column. (Scores tie often: relu zeroes a
    whole entry's score. A fixed rule keeps a query's choice independent of how many entries
    exist past it, so the cached path chooses as this file does.)"""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def select(scores: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """[S, T] bool: each query's top `topk` allowed entries by score."""
    values, indices = top(scores.masked_fill(~allowed, float("-inf")), topk)
    chosen = torch.zeros_like(allowed)
    chosen.scatter_(1, indices, values > float("-inf"))
    return chosen
