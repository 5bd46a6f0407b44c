"""Read a window out of per-slot SWA rings (ring index = position % R).

    ring     [S, R, B]   uint8 (MXFP8 rows) for one layer
    slots    [N]         slot of each sequence
    first    [N]         position of the first row to read (may be negative: rows
                         before position 0 are returned but must be masked by the caller)
    count    rows per sequence
    returns  [N, count, B]
"""

from __future__ import annotations

import torch


def ring_window(ring, slots, first, count: int):
    r = ring.shape[1]
    pos = first.unsqueeze(1) + torch.arange(count, device=first.device).unsqueeze(0)  # [N, count]
    return ring[slots.unsqueeze(1), pos.remainder(r)]


def ring_write(ring, slot: int, first: int, rows):
    """Write rows for positions first .. first + len(rows) - 1; only the last R survive."""
    r = ring.shape[1]
    n = rows.shape[0]
    if n > r:
        rows, first = rows[n - r :], first + n - r
    idx = torch.arange(first, first + rows.shape[0], device=ring.device).remainder(r)
    ring[slot, idx] = rows.to(ring.dtype)
