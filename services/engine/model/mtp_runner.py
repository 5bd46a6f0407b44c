"""MtpRunner: the MTP module's cached forward over a ragged batch (drafts, model/mtp.py).

Each `MtpRows` asks for MTP rows at positions first .. first + n - 1 of one slot, from the
trunk's hidden states (or, chained, the previous depth's outputs) and the next tokens:

    row p   input  x_p = MTP projection of (h_p, embed[t_{p+1}])
            keys   MTP-ring rows of positions max(lo, p - W + 1) .. p: older ones read from
                   the slot's MTP ring (written by earlier calls), this call's from its own
                   rows (the ring is written after it is read)

The MTP ring (`StatePool.mtp[0]`, W + B rows, MXFP8 like every SWA ring, row p % (W + B))
is written for every row computed. Rows past the sequence's committed end (chained drafts)
are rewritten by the next call before anything reads them: a call reads ring rows only
below its own `first`, which the caller (core/mtp_draft.py) keeps at or below the end of
the rows it knows to be valid. Only this class writes the MTP ring.

One call serves every drafting request of a step at one depth (one [T, hidden] tensor,
keys of all rows in one masked pool): no loop per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.ragged import ragged_union_attention
from kernels.ring_rows import ring_put
from services.engine.cache.state_pool import StatePool
from services.engine.config import ModelConfig
from services.engine.device import Uploads
from services.engine.model import mtp, ops
from services.engine.model.batch import Segments


@dataclass
class MtpRows:
    slot: int
    lo: int                    # ring rows of positions < lo are not this sequence's: masked
    first: int                 # position of the first row
    h: torch.Tensor            # [n, hidden] hidden states of positions first .. first + n - 1
    next_tokens: list[int] | torch.Tensor  # [n] token p + 1 of each row (a device tensor:
                                           # a chained draft, never read back)


class MtpRunner:
    def __init__(self, cfg: ModelConfig, weights, states: StatePool):
        if not states.mtp:
            raise ValueError("the slot layout has no MTP ring (--speculative mtp:K builds one)")
        self.cfg, self.w = cfg, weights
        self.block_cfg = mtp.block_config(cfg)
        self.view = mtp.block_view(weights)
        self.ring = states.mtp[0]                      # [S, W + B, 528] uint8
        # the ring's rows dequantized (the same numbers as dequantizing its bytes): this class
        # is the ring's only writer, so the copy never goes stale and reads skip the E4M3 decode
        self.values = torch.zeros(*self.ring.shape[:2], cfg.head_dim, dtype=weights["embed"].dtype,
                                  device=self.ring.device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.device = weights["embed"].device

    @torch.no_grad()
    def forward(self, items: list[MtpRows]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (y [T, hidden] every row's block output, logits [len(items), V] of each item's
        last row). Writes the MTP ring rows of every row."""
        cfg, w, dev, win = self.cfg, self.w, self.device, self.cfg.window
        dtype = w["embed"].dtype
        up = Uploads(dev)          # host ints go up pinned and non-blocking on CUDA
        firsts = [it.first for it in items]
        seg = Segments.build(firsts, [it.first + len(it.next_tokens) for it in items],
                             [it.lo for it in items], dev, up)
        h = torch.cat([it.h for it in items]).to(device=dev, dtype=dtype)
        toks = torch.cat([it.next_tokens if isinstance(it.next_tokens, torch.Tensor)
                          else up.longs(it.next_tokens) for it in items]) \
            if any(isinstance(it.next_tokens, torch.Tensor) for it in items) \
            else up.longs([t for it in items for t in it.next_tokens])
        x = mtp.project(w, cfg, h, toks)
        hn = ops.rms_norm(x, self.view["layers.0.attn_norm"], cfg.norm_eps)
        q, kv = ops.query_and_kv(self.view, 0, hn, seg.pos, self.block_cfg)
        kv_bytes, kv = ops.quantize_kv(kv)

        # older keys: positions [max(lo, first - W + 1), first) of each item, from the ring
        olds = [(i, it.slot, max(it.lo, it.first - win + 1, 0), it.first) for i, it in enumerate(items)]
        old_wid, old_pos, old_slot, item_slots = up.many(
            [i for i, _, a, b in olds for _ in range(a, b)],
            [p for _, _, a, b in olds for p in range(a, b)],
            [s for _, s, a, b in olds for _ in range(a, b)], [it.slot for it in items])
        old = self.values[old_slot, old_pos.remainder(self.ring.shape[1])]
        keys = torch.cat([old, kv])                                          # [Lo + T, D]
        kwid, kpos = torch.cat([old_wid, seg.wid]), torch.cat([old_pos, seg.pos])
        qpos = seg.pos.unsqueeze(1)
        ok = (kwid.unsqueeze(0) == seg.wid.unsqueeze(1)) & (kpos.unsqueeze(0) <= qpos) & \
            (kpos.unsqueeze(0) > qpos - win)                                  # [T, Lo + T]
        o = ragged_union_attention(q, [(keys, ok)], self.view["layers.0.sink"], self.scale)
        x = x + ops.attn_output(self.view, 0, o)
        y = x + ops.ffn(self.view, 0, x, self.block_cfg)

        slots = item_slots[seg.wid]
        ring_put(self.ring, slots, seg.pos, kv_bytes)
        ring_put(self.values, slots, seg.pos, kv)
        return y, mtp.logits(w, cfg, y[seg.cu[1:] - 1])
