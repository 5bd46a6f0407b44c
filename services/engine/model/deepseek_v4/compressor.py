"""The compressors: gated pooling of m tokens into one K = V entry, and the lightning indexer.

HCA (rate m): entry w pools tokens wm .. wm+m-1 with a per-channel softmax over the m slots of
(gate + position bias). CSA (rate m): every token projects two series, A (channels [0, c)) and
B ([c, 2c)); entry w pools A of window w-1 and B of window w over 2m slots, so entries overlap
by m tokens (entry 0 has no A half). Entries are normed, then rotated by the compress RoPE at
position w * m. A window yields its entry only once all m tokens are in.

    tokens   | w-1: t0 t1 t2 t3 | w: t4 t5 t6 t7 | w+1: ...
    entry w  =  softmax-pool( A(t0..t3) , B(t4..t7) )          (CSA, m = 4)

`pool` returns what a cache keeps besides the entries: the raw projections of the open
(partial) window and, for CSA, the last closed window's A series; given them back (`prior`)
it continues the sequence where it stopped.
Entry w is visible to the query at position i iff w < (i + 1) // m.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvmesh.services.engine.model.deepseek_v4.numerics import apply_rope, rms_norm


class Pooled(NamedTuple):
    entries: torch.Tensor        # [T, c] normed and rotated
    open_kv: torch.Tensor        # [S mod m, c or 2c] raw projections of the open window
    open_gate: torch.Tensor      # [S mod m, c or 2c] raw gate (before the position bias)
    overlap_kv: torch.Tensor | None    # CSA: [m, c] A series of the last closed window
    overlap_gate: torch.Tensor | None  # CSA: [m, c] its gate, position bias added
    new_kv: torch.Tensor | None = None     # this call's raw projections, one row per token
    new_gate: torch.Tensor | None = None


def pool(x: torch.Tensor, w: dict, rate: int, overlapping: bool, rope_tables, eps: float,
         prior: Pooled | None = None, stored: bool = False, given: int = 0) -> Pooled:
    """Compress x ([S, D], the normed layer input of the tokens after `prior`'s).

    w: `wkv.weight`, `wgate.weight`, `ape`, `norm.weight` of one compressor.
    rope_tables(positions) -> (cos, sin) of the compress RoPE.
    prior: this compressor's state after the earlier tokens (None: the sequence starts here);
    the result carries all entries so far and the state after x.
    stored: round the projections and the entries to fp32 where they are made, as the
    engine's ledgers keep them (tails and blocks are fp32), so a run that reads them back
    and one that never stored them compute the same.
    given: bounded replay. The first `given` rows of x end on a window boundary and their
    entries are already `prior`'s (cached, never recomputed); only the rows after them are
    pooled, the next CSA entry's A half taken from the last window of the given rows.
    """
    kv = F.linear(x, w["wkv.weight"])
    gate = F.linear(x, w["wgate.weight"])
    if stored:
        kv, gate = kv.float().to(kv.dtype), gate.float().to(gate.dtype)
    new_kv, new_gate = kv, gate
    if given:
        if prior is None or prior.open_kv.shape[0] or given % rate or given < rate:
            raise ValueError("given rows need a prior without open rows, ending on a window")
        if overlapping:
            half = kv.shape[-1] // 2
            last_kv, last_gate = kv[given - rate:given], gate[given - rate:given] + w["ape"]
            prior = prior._replace(overlap_kv=last_kv[:, :half], overlap_gate=last_gate[:, :half])
        kv, gate = kv[given:], gate[given:]
    first_window = 0
    if prior is not None:
        first_window = prior.entries.shape[0]
        kv = torch.cat([prior.open_kv, kv])
        gate = torch.cat([prior.open_gate, gate])
    closed = kv.shape[0] // rate * rate
    n = closed // rate
    width = kv.shape[-1] // 2 if overlapping else kv.shape[-1]
    win_kv = kv[:closed].view(n, rate, kv.shape[-1])
    win_gate = gate[:closed].view(n, rate, gate.shape[-1]) + w["ape"]
    overlap_kv, overlap_gate = (prior.overlap_kv, prior.overlap_gate) if prior else (None, None)
    if overlapping:
        # slots [0, m): window w-1's A series; [m, 2m): window w's B series
        slots_kv = win_kv.new_zeros((n, 2 * rate, width))
        slots_gate = win_gate.new_full((n, 2 * rate, width), float("-inf"))
        slots_kv[:, rate:] = win_kv[..., width:]
        slots_gate[:, rate:] = win_gate[..., width:]
        if n > 1:
            slots_kv[1:, :rate] = win_kv[:-1, :, :width]
            slots_gate[1:, :rate] = win_gate[:-1, :, :width]
        if n and overlap_kv is not None:  # the window before this call's first
            slots_kv[0, :rate] = overlap_kv
            slots_gate[0, :rate] = overlap_gate
        if n:
            overlap_kv, overlap_gate = win_kv[-1, :, :width], win_gate[-1, :, :width]
        win_kv, win_gate = slots_kv, slots_gate
    weights = win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
    entries = rms_norm((win_kv * weights).sum(dim=1), w["norm.weight"], eps)
    if n:
        positions = (torch.arange(n, device=entries.device) + first_window) * rate
        cos, sin = rope_tables(positions)
        entries = apply_rope(entries, cos, sin)
    if stored:
        entries = entries.float().to(entries.dtype)
    if prior is not None:
        entries = torch.cat([prior.entries, entries])
    return Pooled(entries, kv[closed:], gate[closed:], overlap_kv, overlap_gate, new_kv, new_gate)


def visible(positions: torch.Tensor, n_entries: int, rate: int) -> torch.Tensor:
    """[S, T] bool: entry w is visible to the query at position i iff w < (i + 1) // rate."""
    return torch.arange(n_entries, device=positions.device).view(1, -1) < \
        ((positions + 1) // rate).view(-1, 1)


def index_select(x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor, w: dict,
                 positions: torch.Tensor, rate: int, topk: int, rope_tables) -> torch.Tensor:
    """The lightning indexer's choice: [S, T] bool, the entries each query attends to.

    Score I[i, t] = sum_h weight[i, h] * relu(q[i, h] . key[t]) / sqrt(c_I), all in fp32, with
    weight = weights_proj(x) / sqrt(H_I); the top min(topk, T) visible entries are kept.
    w: `wq_b.weight`, `weights_proj.weight` of the indexer; keys: [T, c_I] from `pool`.
    """
    n_entries = keys.shape[0]
    chosen = torch.zeros(x.shape[0], n_entries, dtype=torch.bool, device=x.device)
    if n_entries == 0:
        return chosen
    heads, dim = w["weights_proj.weight"].shape[0], keys.shape[-1]
    q = F.linear(q_res, w["wq_b.weight"]).view(x.shape[0], heads, dim)
    cos, sin = rope_tables(positions)
    q = apply_rope(q, cos, sin)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2).float())  # [S, H_I, T]
    scores = F.relu(scores) * dim ** -0.5
    head_weights = F.linear(x, w["weights_proj.weight"]).float() * heads ** -0.5
    total = (scores * head_weights.unsqueeze(-1)).sum(dim=1)  # [S, T]
    seen = visible(positions, n_entries, rate)
    total = total.masked_fill(~seen, float("-inf"))
    picks = total.topk(min(topk, n_entries), dim=-1).indices
    chosen.scatter_(1, picks, True)
    return chosen & seen  # picks that landed on future entries are dropped
