"""The compressor's group path in one C call on the CPU (kernels/cpu/pool_groups.c, in the
library kernels/cpu_ring.py builds): completed groups pooled (softmax-gated), normed and
roped, and written to their block rows, where torch takes a gather of the group's rows, a
dozen elementwise calls and a scatter per layer and stream.

Why: at batch 32 some sequence completes a CSA group on every decode step, so the group path
runs for every CSA layer (entries and indexer keys) every step, at batch 1 one step in m; its
cost is per call (~0.28 ms per layer and stream at batch 32 in torch), which makes it one of
the few pieces of a decode step that grows with the batch for no arithmetic.

`pool_into` returns False when it cannot run (no library, KVMESH_KERNELS set, not a CPU
float32/float64 tensor, a tail ring that is not fp32 rows, rows wider than MAX_D, more than
MAX_GROUPS groups or groups longer than MAX_ROWS): the caller then runs the torch path
(compressor.py), which computes the same entries up to the rounding of exp and of the norm's
sum (float64: ~1e-16; tested).
"""

from __future__ import annotations

import torch

from kernels import cpu_ring
from kernels.ring_rows import RingAt

MAX_D, MAX_M = 1024, 256      # the C file's MAX_POOL_D and MAX_M (its per-call buffers)
# MAX_GROUPS was set when the C loop's exp was libm's scalar expf (torch's softmax is
# vectorized and threaded): the call paid where the torch path is many small calls around
# little arithmetic (a decode step's few groups of m = 4: 8 groups 134 -> 134 us alone, and
# the ~20 calls per stream it replaces), not on a prefill chunk's 128 groups (1.7 ms either
# way). The exp is vectorized now (exp_lanes.h: 8 groups 56.7 -> 21.2 us), and an HCA group
# of 128 rows, which then took 371 us against torch's 180, is the C call's too: an HCA
# layer's feed with a completed group, 32 decoding sequences, median 766 -> 401 us (2
# threads). Such a group completes every 128 tokens of every sequence, and beside a prompt's
# chunks the torch path's was a step's largest spike. Past these the torch path runs.
MAX_GROUPS, MAX_ROWS = 32, 128         # MAX_ROWS <= MAX_M (tested): the C buffers hold them


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def pool_into(table: torch.Tensor, rows: torch.Tensor, v: torch.Tensor, z: torch.Tensor,
              ring: torch.Tensor, tail_at: RingAt | None, pick: torch.Tensor | None, m: int,
              bias: torch.Tensor, norm_w: torch.Tensor | None = None, eps: float = 0.0,
              angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Pool G = len(rows) groups and write group g's entry into table row rows[g].

    table [N, D] fp32 (a flat view of the block store), rows [G] long; v, z [n_fed, D] the fed
    rows (float32 or float64); ring [S, R, 2, D] fp32 the tail ring (read before this step
    writes it), tail_at where the stream's stored rows are; pick [G * m] the stream (None:
    the fed rows in order); bias [m, D]; norm_w [D] and angles (cos, sin [G, rope_dim / 2])
    for entries, None for indexer keys. False: not done (use the torch path)."""
    lib = cpu_ring.library(v)
    if lib is None or ring.dtype != torch.float32 or ring.stride(-1) != 1 or \
            table.dtype != torch.float32 or not table.is_contiguous() or \
            v.shape[-1] > MAX_D or m > MAX_ROWS or rows.numel() > MAX_GROUPS:
        return False
    dt = v.dtype
    v, z = v.contiguous(), z.contiguous()
    bias = bias.to(dt).contiguous()
    norm_w = None if norm_w is None else norm_w.to(dt).contiguous()
    cos, sin = (None, None) if angles is None else (angles[0].to(dt).contiguous(),
                                                    angles[1].to(dt).contiguous())
    rows = rows.to(torch.int64).contiguous()
    pick = None if pick is None else pick.to(torch.int64).contiguous()
    slots = tail = None
    if tail_at is not None:
        slots, tail = tail_at.slots.to(torch.int64).contiguous(), tail_at.rows.to(torch.int64).contiguous()
    g, d = rows.numel(), v.shape[-1]
    if table.shape[-1] != d or bias.shape != (m, d):
        raise ValueError(f"table rows of {table.shape[-1]} and bias {tuple(bias.shape)} for "
                         f"{d}-wide groups of {m}")
    if pick is not None and pick.numel() != g * m:
        raise ValueError(f"pick has {pick.numel()} rows for {g} groups of {m}")
    fn = lib.pool_groups_f32 if dt == torch.float32 else lib.pool_groups_f64
    keep = (v, z, bias, norm_w, cos, sin, rows, pick, slots, tail)      # alive past the call
    rc = fn(v.data_ptr(), z.data_ptr(), v.shape[0], ring.data_ptr(), _ptr(slots), _ptr(tail),
            ring.stride(0), ring.stride(1), ring.stride(2),
            _ptr(pick), g, m, d, bias.data_ptr(), _ptr(norm_w), eps, _ptr(cos), _ptr(sin),
            0 if cos is None else 2 * cos.shape[-1], table.data_ptr(), rows.data_ptr(),
            torch.get_num_threads())
    del keep
    if rc:
        raise ValueError(f"pool_groups refused groups of {m} x {d} (rc {rc})")
    return True
