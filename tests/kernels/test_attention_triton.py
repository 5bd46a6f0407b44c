"""Triton ring attention against the torch reference (kernels.attention.ring_attention_torch).

Small shapes, fp32, relative error <= 1e-3 of the output's largest magnitude. The cases
cover ring wrap-around, a window truncated at every offset relative to the chunk, sinks
(from negligible to dominant), HCA (shared entries), CSA (per-query gathered picks) and
empty compressed sets.
"""

import pytest
import torch

from kernels import attention, mxfp8
from kernels.triton import attention as tri

D, W, R, H = 64, 8, 11, 3          # R > W: the ring keeps more rows than the window reads
TOL = 1e-3


def _close(got, want):
    err = float((got.cpu() - want).abs().max())
    assert err <= TOL * float(want.abs().max()), err


def _setup(n_seq, t, first, seed, sink_scale=1.0):
    """n_seq sequences, each in its own slot with its ring filled for positions < first[n]."""
    g = torch.Generator().manual_seed(seed)
    ring = torch.zeros(n_seq + 1, R, D + D // 32, dtype=torch.uint8)
    for n, p0 in enumerate(first):
        pos = torch.arange(max(0, p0 - R), p0)
        ring[n + 1, pos % R] = mxfp8.quantize_torch(torch.randn(len(pos), D, generator=g) * 3)
    chunk = mxfp8.quantize_torch(torch.randn(n_seq, t, D, generator=g) * 3)
    q = torch.randn(n_seq, t, H, D, generator=g)
    qpos = torch.tensor(first).unsqueeze(1) + torch.arange(t)
    sink = torch.randn(H, generator=g) * sink_scale
    return g, ring, torch.arange(1, n_seq + 1), chunk, q, qpos, sink


def _both(device, q, ring, slots, chunk, qpos, valid, lo, sink, cmp=None, scale=0.125):
    want = attention.ring_attention_torch(q, ring, slots, chunk, qpos, valid, lo, W, sink, scale, cmp)
    dev = [x.to(device) for x in (q, ring, slots, chunk, qpos, valid, lo, sink)]
    dcmp = None if cmp is None else tuple(None if c is None else c.to(device) for c in cmp)
    got = tri.ring_attention(*dev[:7], W, dev[7], scale, dcmp)
    return got, want


def test_window_truncated_at_every_offset_across_wrap(device):
    # chunk of 4 rows starting at 29 (ring rows wrap: 29 % 11 = 7); one sequence per lower
    # bound lo from 29 - W - 1 (no truncation) to 33 (past the chunk: only sinks remain)
    t, p0 = 4, 29
    los = list(range(p0 - W - 1, p0 + t + 1))
    g, ring, slots, chunk, q, qpos, sink = _setup(len(los), t, [p0] * len(los), seed=3)
    valid = torch.ones(len(los), t, dtype=torch.bool)
    got, want = _both(device, q, ring, slots, chunk, qpos, valid, torch.tensor(los), sink)
    _close(got, want)
    # a query whose window is empty (lo past it) returns 0: only the sink is left
    assert torch.all(want[-1] == 0) and torch.all(got[-1].cpu() == 0)


def test_decode_rows_at_every_ring_phase_and_near_position_zero(device):
    # one decode row per sequence, positions 0 .. 2R: fresh sequences (keys before 0 masked)
    # and every phase of the ring
    first = list(range(0, 2 * R + 1))
    g, ring, slots, chunk, q, qpos, sink = _setup(len(first), 1, first, seed=4)
    valid = torch.ones(len(first), 1, dtype=torch.bool)
    got, want = _both(device, q, ring, slots, chunk, qpos, valid, torch.zeros(len(first), dtype=torch.long), sink)
    _close(got, want)


@pytest.mark.parametrize("sink_scale", [0.0, 1.0, 30.0])
def test_sinks_and_padding_rows(device, sink_scale):
    g, ring, slots, chunk, q, qpos, sink = _setup(3, 5, [0, 6, 40], seed=5, sink_scale=sink_scale)
    sink[0] = 12.0                       # one head mostly attends to nothing
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    got, want = _both(device, q, ring, slots, chunk, qpos, valid, torch.tensor([0, 3, 35]), sink)
    _close(got, want)
    assert torch.all(got.cpu()[~valid] == 0)


def test_hca_entries_shared_by_the_rows(device):
    g, ring, slots, chunk, q, qpos, sink = _setup(2, 6, [17, 30], seed=6)
    valid = torch.ones(2, 6, dtype=torch.bool)
    keys = torch.randn(2, 9, D, generator=g) * 3
    m = 4                                # entry j visible iff j < (i + 1) // m
    ok = torch.arange(9).view(1, 1, 9) < ((qpos + 1) // m).unsqueeze(2)
    got, want = _both(device, q, ring, slots, chunk, qpos, valid, torch.tensor([12, 0]), sink,
                      (keys, ok, None))
    _close(got, want)


def test_csa_gathered_picks(device):
    g, ring, slots, chunk, q, qpos, sink = _setup(2, 5, [9, 21], seed=7)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    keys = torch.randn(2, 40, D, generator=g) * 3
    idx = torch.stack([torch.randperm(40, generator=g)[:20].view(5, 4) for _ in range(2)])
    ok = (torch.rand(2, 5, 4, generator=g) > 0.25) & valid.unsqueeze(2)
    got, want = _both(device, q, ring, slots, chunk, qpos, valid, torch.tensor([0, 14]), sink,
                      (keys, ok, idx))
    _close(got, want)
    # and the gather matters: reading entries 0..3 instead gives something else
    other, _ = _both(device, q, ring, slots, chunk, qpos, valid, torch.tensor([0, 14]), sink,
                     (keys[:, :4].contiguous(), ok, None))
    assert float((other.cpu() - want).abs().max()) > 1e-2


def test_empty_compressed_sets(device):
    g, ring, slots, chunk, q, qpos, sink = _setup(2, 3, [5, 12], seed=8)
    valid = torch.ones(2, 3, dtype=torch.bool)
    lo = torch.zeros(2, dtype=torch.long)
    plain, want = _both(device, q, ring, slots, chunk, qpos, valid, lo, sink)
    _close(plain, want)
    none_yet = (torch.zeros(2, 0, D), torch.zeros(2, 3, 0, dtype=torch.bool), None)
    got, want0 = _both(device, q, ring, slots, chunk, qpos, valid, lo, sink, none_yet)
    _close(got, want0)
    no_picks = (torch.zeros(2, 0, D), torch.zeros(2, 3, 0, dtype=torch.bool),
                torch.zeros(2, 3, 0, dtype=torch.long))
    got2, _ = _both(device, q, ring, slots, chunk, qpos, valid, lo, sink, no_picks)
    masked = (torch.randn(2, 5, D, generator=g), torch.zeros(2, 3, 5, dtype=torch.bool), None)
    got3, want3 = _both(device, q, ring, slots, chunk, qpos, valid, lo, sink, masked)
    _close(got3, want3)
    for x in (got, got2, got3):
        assert torch.equal(x.cpu(), plain.cpu())       # nothing visible adds nothing


def test_dispatch_routes_attention(monkeypatch, device):
    g, ring, slots, chunk, q, qpos, sink = _setup(1, 2, [4], seed=9)
    valid = torch.ones(1, 2, dtype=torch.bool)
    lo = torch.zeros(1, dtype=torch.long)
    args = [x.to(device) for x in (q, ring, slots, chunk, qpos, valid, lo)]
    monkeypatch.setenv("KVMESH_KERNELS", "triton")
    got = attention.ring_attention(*args, W, sink.to(device), 0.125)
    want = attention.ring_attention_torch(q, ring, slots, chunk, qpos, valid, lo, W, sink, 0.125)
    _close(got, want)
