"""DeepSeek V4 / V4.1 split over ranks: tensor (TP) and expert parallel (EP) on torch.distributed.

An engine of `tp x ep` ranks; rank r sits at (e, t) = (r // tp, r % tp): the ranks of one e
form a TP group. What a rank holds (`shard_weights`):

    replicated    embedding, hyper-connection and norm weights, wq_a, wkv (the one K = V
                  head), the compressors and the indexer, the router, the MTP modules
    by t          its tp-th of the query heads (wq_b rows, attention sinks) and of their
                  output groups (wo_a rows, wo_b columns), and of the vocabulary (head rows)
    by e, then t  its ep-th of the routed experts, each expert's intermediate dim cut by t
    by rank       its world-th of the shared expert's intermediate dim

and the sums that make the whole model's numbers from the shares (`ParallelV4Model`):
attention's output is summed over the TP group (the ranks of one e compute the same heads,
so each group sums alone); the MoE block, routed plus shared, is summed over the world;
the logits are gathered over the TP group. Every rank's caches hold the same rows: the
window's K = V head and the compressed entries come from replicated weights.

Sums run in another order than one process's, so a split model matches it to rounding
(tests/engine/deepseek_v4/test_parallel.py bounds it), not bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.config import V4Config
from kvmesh.services.engine.model.deepseek_v4.forward import V4Model
from kvmesh.services.engine.model.deepseek_v4.moe import route, route_v41, routed_pairs, shared
from kvmesh.services.engine.model.deepseek_v4.v41_config import V41Config
from kvmesh.services.engine.model.deepseek_v4.v41_forward import V41Model


@dataclass(frozen=True)
class Split:
    """One rank's place in a tp x ep engine."""
    tp: int = 1
    ep: int = 1
    rank: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.ep

    @property
    def t(self) -> int:
        return self.rank % self.tp

    @property
    def e(self) -> int:
        return self.rank // self.tp

    def tp_ranks(self, e: int) -> list[int]:
        return [e * self.tp + t for t in range(self.tp)]

    def check(self, cfg: V4Config | V41Config) -> None:
        """ValueError naming the config field a split does not divide."""
        if self.tp < 1 or self.ep < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"tensor-parallel {self.tp} x expert-parallel {self.ep}: no rank "
                             f"{self.rank}")
        for name, size, parts in (("num_attention_heads", cfg.num_heads, self.tp),
                                  ("o_groups", cfg.o_groups, self.tp),
                                  ("vocab_size", cfg.vocab_size, self.tp),
                                  ("n_routed_experts", cfg.n_experts, self.ep),
                                  ("moe_intermediate_size", cfg.moe_inter, self.world)):
            if size % parts:
                raise ValueError(f"{name} ({size}) is not divisible by {parts} "
                                 f"(tensor-parallel {self.tp} x expert-parallel {self.ep})")


def local_config(cfg: V4Config | V41Config, split: Split) -> V4Config | V41Config:
    """The config a rank computes attention with: its share of the heads and output groups."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // split.tp,
                               o_groups=cfg.o_groups // split.tp)


def _cut(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    size = x.shape[dim] // parts
    return x.narrow(dim, index * size, size).contiguous()


def experts_held(cfg: V4Config, split: Split) -> range:
    """The routed experts a rank holds (of every layer)."""
    n = cfg.n_experts // split.ep
    return range(split.e * n, (split.e + 1) * n)


def shard(name: str, x: torch.Tensor, cfg: V4Config, split: Split,
          experts_cut: bool = False) -> torch.Tensor:
    """A rank's share of the tensor `name` (the package's names, names.py). experts_cut: a
    stacked expert tensor holds the rank's experts only already (as the loader reads it)."""
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    t, tp = split.t, split.tp
    if leaf in ("attn.wq_b.weight", "attn.attn_sink", "attn.wo_a.weight") or name == "head.weight":
        return _cut(x, 0, tp, t)          # heads' rows (wq_b: head-major), groups' rows, vocab
    if leaf == "attn.wo_b.weight":
        return _cut(x, 1, tp, t)
    if leaf in ("ffn.experts.w13", "ffn.experts.w2") and not experts_cut:
        held = experts_held(cfg, split)
        x = x[held.start:held.stop]
    if leaf == "ffn.experts.w13":         # [E, 2I, D]: gate rows, then up rows
        gate, up = x.chunk(2, dim=1)
        return torch.cat([_cut(gate, 1, tp, t), _cut(up, 1, tp, t)], dim=1)
    if leaf == "ffn.experts.w2":          # [E, D, I]
        return _cut(x, 2, tp, t)
    if leaf in ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"):
        return _cut(x, 0, split.world, split.rank)
    if leaf == "ffn.shared_experts.w2.weight":
        return _cut(x, 1, split.world, split.rank)
    return x


def shard_weights(cfg: V4Config, weights: dict[str, torch.Tensor], split: Split
                  ) -> dict[str, torch.Tensor]:
    """A rank's weights from the whole model's (tests; a deployment reads only its slices)."""
    split.check(cfg)
    return {name: x if name.startswith("mtp.") else shard(name, x, cfg, split)
            for name, x in weights.items()}


class Groups:
    """The process groups one rank sums over: the world, and its TP group. Built on every rank
    in the same order (torch.distributed.new_group is collective)."""

    def __init__(self, split: Split):
        self.split = split
        self.tp_group = None
        if split.world > 1:
            for e in range(split.ep):
                group = dist.new_group(split.tp_ranks(e))
                if e == split.e:
                    self.tp_group = group

    def sum_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.split.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def sum_world(self, x: torch.Tensor) -> torch.Tensor:
        if self.split.world > 1:
            dist.all_reduce(x)
        return x

    def gather_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Each TP rank's columns (last dim), concatenated in rank order."""
        if self.split.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.split.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


class _Shares:
    """What a rank of a split model computes differently from the whole model: its shares
    of attention, the MoE and the logits, summed or gathered over the ranks."""
    split: Split
    groups: Groups
    weights: dict[str, torch.Tensor]

    def attention_total(self, out: torch.Tensor) -> torch.Tensor:
        return self.groups.sum_tp(out.contiguous())

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.groups.gather_tp(F.linear(h, self.weights["head.weight"]))

    def _moe_share(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                   w: dict, limit: float) -> torch.Tensor:
        """This rank's experts on the (token, expert) pairs routed to them, plus its share
        of the shared expert, summed over the world: the MoE block's output."""
        held = w["experts.w13"].shape[0]
        first = self.split.e * held
        flat = experts.reshape(-1)
        mine = (flat >= first) & (flat < first + held)
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(experts.shape[1])
        out = routed_pairs(x, tokens[mine], flat[mine] - first, weights.reshape(-1)[mine],
                           w["experts.w13"], w["experts.w2"], limit)
        return self.groups.sum_world(out + shared(x, w, limit))


class ParallelV4Model(_Shares, V4Model):
    """One rank of a DeepSeek V4 split tp x ep ways. Every rank runs the same calls on the
    same rows (the same token ids, positions and priors) and gets the whole model's
    outputs; `weights` are the rank's own (`shard_weights`), `cfg` the whole model's."""

    def __init__(self, cfg: V4Config, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 split: Split, groups: Groups, stored: bool = False, rows: str = "mxfp8"):
        split.check(cfg)
        super().__init__(local_config(cfg, split), weights, dtype, stored, rows)
        self.whole, self.split, self.groups = cfg, split, groups

    def mlp(self, i: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.ffn[i]
        experts, weights = route(cfg, cfg.mlp_kinds[i], w, x, ids)
        return self._moe_share(x, experts, weights, w, cfg.swiglu_limit)


class ParallelV41Model(_Shares, V41Model):
    """One rank of a DeepSeek V4.1 text model split tp x ep ways, as ParallelV4Model."""

    def __init__(self, cfg: V41Config, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 split: Split, groups: Groups, rows: str | None = None):
        split.check(cfg)
        super().__init__(local_config(cfg, split), weights, dtype, rows)
        self.whole, self.split, self.groups = cfg, split, groups

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w = self.ffn[i]
        experts, weights = route_v41(self.cfg, w, x)
        return self._moe_share(x, experts, weights, w, self.cfg.swiglu_limit)


def weight_bytes(cfg: V4Config | V41Config, split: Split, itemsize: int, mtp: bool = True) -> int:
    """Bytes of the weights one rank holds, computed in a dtype of `itemsize` bytes (the
    loader's: what names.keeps_fp32 names stays fp32, token-to-expert tables are int64, a
    quantized checkpoint's Engram tables stay FP8)."""
    from kvmesh.services.engine.model.deepseek_v4 import names, v41_names

    if isinstance(cfg, V41Config):
        shapes = dict(v41_names.expected_shapes(cfg))
    else:
        shapes = dict(names.expected_shapes(cfg))
        if mtp and cfg.num_mtp_layers:
            shapes.update(names.mtp_shapes(cfg))
    total = 0
    for name, shape in shapes.items():
        held = shape if name.startswith("mtp.") else \
            shard(name, torch.empty(shape, device="meta"), cfg, split).shape
        count = int(torch.Size(held).numel())
        if name.endswith("engram.embed.weight") and cfg.quantization is not None:
            total += count + count // 32      # kept as stored: FP8 and a scale byte per 32
            continue
        size = 8 if name.endswith("tid2eid") else max(itemsize, 4) if names.keeps_fp32(name) \
            else itemsize
        total += size * count
    return total


def rank_report(cfg: V4Config | V41Config, tp: int, ep: int, itemsize: int) -> dict:
    """What one rank of a tp x ep engine holds: its weights (every rank alike when the
    config divides), and the ledgers, which every rank holds whole."""
    split = Split(tp, ep, 0)
    split.check(cfg)
    per_rank = [weight_bytes(cfg, Split(tp, ep, r), itemsize) for r in range(tp * ep)]
    return {"tensor_parallel": tp, "expert_parallel": ep, "ranks": tp * ep,
            "weight_bytes_per_rank": max(per_rank), "weight_bytes_whole": weight_bytes(
                cfg, Split(), itemsize), "weight_itemsize": itemsize,
            "ledgers": "the same on every rank (replicated K = V head and compressed entries)"}
