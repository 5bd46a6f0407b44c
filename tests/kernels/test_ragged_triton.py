"""Triton ragged union attention (kernels/triton/ragged.py) against the torch ragged op
(kernels.ragged.ragged_union_attention on CPU, its reference).

Small shapes, fp32, error <= 1e-3 of the output's largest magnitude. One flattened batch
mixes decode rows and short chunks of several slots (not dense, not in slot order), the
rings wrap, the window is truncated at every offset (lo from below the window to past the
row), the ring is read as the mirror's fp32 rows and as the MXFP8 bytes themselves, and
window groups of every kind (ring in place, per-row gathered keys, one shared pool) are
merged with compressed entries (HCA shared, CSA per-row picks, empty sets) and sinks.
The products are checked both ways: bf16 tensor-core halves ("split", the compiled
default) and fp32 IEEE ("ieee", the interpreter's default).
"""

import pytest
import torch

from kernels import mxfp8
from kernels import ragged as rg
from kernels.triton import ragged as tri

D, W, R, H, S = 64, 8, 11, 3, 9     # R > W: a ring keeps more rows than one window reads
TOL = 1e-3


def _close(got, want):
    err = float((got.cpu() - want).abs().max())
    assert err <= TOL * float(want.abs().max()), err


def _ring(g):
    codes = mxfp8.quantize_torch(torch.randn(S, R, D, generator=g) * 3)
    return mxfp8.dequantize_torch(codes), codes


def _rows(works):
    """works: (slot, first position, rows, lo) -> per-row slots, positions, ring-row masks.
    Ring row r of a work ending at e holds x(r) = e - 1 - ((e - 1 - r) mod R) (windows.py);
    row p sees it when max(lo, p - W + 1, 0) <= x(r) <= p."""
    slots, pos, oks = [], [], []
    for slot, first, n, lo in works:
        e = first + n
        held = e - 1 - torch.remainder(e - 1 - torch.arange(R), R)
        for p in range(first, e):
            slots.append(slot)
            pos.append(p)
            oks.append((held >= max(lo, p - W + 1, 0)) & (held <= p))
    return slots, torch.tensor(pos), torch.stack(oks)


def _both(q, groups, sink, device, scale=0.125, precision=None, parts=None):
    want = rg.ragged_union_attention(q, groups, sink, scale)         # torch on CPU
    moved = []
    for grp in groups:
        if isinstance(grp, rg.RingKeys):
            rows = rg.SlotRows.build(grp.rows.slots.tolist(), device)
            moved.append(rg.RingKeys(grp.values.to(device), rows, grp.ok.to(device),
                                     None if grp.codes is None else grp.codes.to(device)))
        else:
            moved.append(tuple(x.to(device) for x in grp))
    return tri.union_attention(q.to(device), moved, sink.to(device), scale, precision,
                               parts), want


# decode rows and short chunks of slots 7, 2, 5, 0 (a range too sparse for a view), wrapping
MIXED = [(7, 40, 1, 0), (2, 3, 4, 0), (5, 29, 1, 27), (0, 0, 1, 0), (2 + 6, 16, 3, 12)]


@pytest.mark.parametrize("precision", ["split", "ieee"])
@pytest.mark.parametrize("mx", [False, True], ids=["mirror", "mxfp8"])
def test_ring_rows_mixed_decode_and_chunks(device, mx, precision):
    g = torch.Generator().manual_seed(1)
    values, codes = _ring(g)
    slots, pos, ok = _rows(MIXED)
    q = torch.randn(len(slots), H, D, generator=g)
    sink = torch.randn(H, generator=g)
    ring = rg.RingKeys(values, rg.SlotRows.build(slots), ok, codes if mx else None)
    got, want = _both(q, [ring], sink, device, precision=precision)
    _close(got, want)


@pytest.mark.parametrize("precision", ["split", "ieee"])
@pytest.mark.parametrize("mx", [False, True], ids=["mirror", "mxfp8"])
def test_window_truncated_at_every_offset_across_the_wrap(device, mx, precision):
    # one 3-row chunk at 30..32 (ring rows wrap: 30 % 11 = 8) per lower bound, from below
    # the window (no truncation) to past the last row (only the sink is left)
    first, n = 30, 3
    works = [(s, first, n, lo) for s, lo in enumerate(range(first - W - 1, first + n + 1))]
    g = torch.Generator().manual_seed(2)
    codes = mxfp8.quantize_torch(torch.randn(len(works), R, D, generator=g) * 3)
    slots, pos, ok = _rows(works)
    q = torch.randn(len(slots), H, D, generator=g)
    sink = torch.randn(H, generator=g)
    ring = rg.RingKeys(mxfp8.dequantize_torch(codes), rg.SlotRows.build(slots), ok,
                       codes if mx else None)
    got, want = _both(q, [ring], sink, device, precision=precision)
    _close(got, want)
    assert not bool(ok[-n:].any())                       # lo past the rows: nothing visible
    assert torch.all(want[-n:] == 0) and torch.all(got[-n:].cpu() == 0)


@pytest.mark.parametrize("sink_scale", [0.0, 1.0, 30.0])
def test_ring_with_compressed_entries_and_sinks(device, sink_scale):
    g = torch.Generator().manual_seed(3)
    values, codes = _ring(g)
    slots, pos, ok = _rows(MIXED)
    t = len(slots)
    q = torch.randn(t, H, D, generator=g)
    sink = torch.randn(H, generator=g) * sink_scale
    sink[0] = 12.0                                       # one head mostly attends to nothing
    ring = rg.RingKeys(values, rg.SlotRows.build(slots), ok, codes)
    picks = torch.randn(t, 5, D, generator=g) * 3        # CSA: each row's own top-k entries
    pick_ok = torch.rand(t, 5, generator=g) > 0.3
    got, want = _both(q, [ring, (picks, pick_ok)], sink, device, precision="split")
    _close(got, want)


def test_gathered_window_with_shared_hca_entries(device):
    # the gather path (each row's W keys by index) and HCA entries shared by all rows
    g = torch.Generator().manual_seed(4)
    t = 7
    keys = mxfp8.dequantize_torch(mxfp8.quantize_torch(torch.randn(t, W, D, generator=g) * 3))
    ok = torch.rand(t, W, generator=g) > 0.2
    ok[3] = False                                        # a row with its window masked away
    entries = torch.randn(13, D, generator=g) * 3
    vis = torch.arange(13).unsqueeze(0) < torch.tensor([0, 1, 4, 13, 13, 7, 2]).unsqueeze(1)
    q = torch.randn(t, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    got, want = _both(q, [(keys, ok), (entries, vis)], sink, device)
    _close(got, want)


def shared_pool(g, t: int, window: int, d: int, lo: int):
    """A long chunk's window pool: the W - 1 older rows (positions -W+1..-1) then the chunk's t
    rows (0..t-1); row p sees positions max(lo, p - W + 1)..p. -> (pool [W - 1 + t, d], ok)."""
    old = window - 1
    pool = torch.randn(old + t, d, generator=g) * 3
    kpos = torch.arange(-old, t)
    p = torch.arange(t).unsqueeze(1)
    return pool, (kpos.unsqueeze(0) <= p) & (kpos.unsqueeze(0) >= torch.clamp(p - window + 1, min=lo))


def test_shared_pool_window_with_csa_picks(device):
    # the pool path: a long chunk's rows share one key pool (older rows + chunk rows)
    g = torch.Generator().manual_seed(5)
    t = 20
    pool, ok = shared_pool(g, t, W, D, lo=3)
    picks = torch.randn(t, 4, D, generator=g) * 3
    pick_ok = torch.rand(t, 4, generator=g) > 0.5
    q = torch.randn(t, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    got, want = _both(q, [(pool, ok), (picks, pick_ok)], sink, device)
    _close(got, want)


def test_empty_compressed_sets_add_nothing(device):
    g = torch.Generator().manual_seed(6)
    values, codes = _ring(g)
    slots, pos, ok = _rows(MIXED)
    t = len(slots)
    q = torch.randn(t, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    ring = rg.RingKeys(values, rg.SlotRows.build(slots), ok, codes)
    plain, want = _both(q, [ring], sink, device)
    _close(plain, want)
    for empty in ((torch.zeros(t, 0, D), torch.zeros(t, 0, dtype=torch.bool)),
                  (torch.zeros(0, D), torch.zeros(t, 0, dtype=torch.bool)),
                  (torch.randn(t, 4, D, generator=g), torch.zeros(t, 4, dtype=torch.bool))):
        got, want_e = _both(q, [ring, empty], sink, device)
        _close(got, want_e)
        assert torch.equal(got.cpu(), plain.cpu())       # nothing visible adds nothing


def test_dispatch_routes_ragged_attention(monkeypatch, device):
    g = torch.Generator().manual_seed(7)
    values, codes = _ring(g)
    slots, pos, ok = _rows(MIXED[:2])
    q = torch.randn(len(slots), H, D, generator=g)
    sink = torch.randn(H, generator=g)
    ring = rg.RingKeys(values, rg.SlotRows.build(slots), ok, codes)
    want = rg.ragged_union_attention(q, [ring], sink, 0.125)
    calls = []
    kernel = tri.union_attention
    monkeypatch.setattr(tri, "union_attention", lambda *a: calls.append(1) or kernel(*a))
    got = rg.ragged_union_attention(q.to(device), [rg.RingKeys(
        values.to(device), rg.SlotRows.build(slots, device), ok.to(device), codes.to(device))],
        sink.to(device), 0.125) if device == "cuda" else None
    if device != "cuda":                     # on CPU the default is torch; forcing picks Triton
        assert not calls
        monkeypatch.setenv("KVMESH_KERNELS", "triton")
        got = rg.ragged_union_attention(q, [ring], sink, 0.125)
    assert calls == [1]
    _close(got, want)
    # float64 (the engine's exactness runs) always takes the torch path
    rg.ragged_union_attention(q.double(), [rg.RingKeys(values.double(), ring.rows, ok)],
                              sink.double(), 0.125)
    assert calls == [1]


@pytest.mark.parametrize("precision, bound", [("split", 1e-4), ("ieee", 1e-5)])
def test_products_against_float64(device, precision, bound):
    # the default "split" runs its products on bf16 tensor cores from hi/lo halves (MXFP8
    # keys are exact in bf16; fp32 CSA picks are split too); both stay fp32-grade
    g = torch.Generator().manual_seed(8)
    values, codes = _ring(g)
    slots, pos, ok = _rows(MIXED)
    t = len(slots)
    q = torch.randn(t, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    picks = torch.randn(t, 6, D, generator=g) * 3
    pick_ok = torch.rand(t, 6, generator=g) > 0.3
    want = rg.ragged_union_attention(
        q.double(), [rg.RingKeys(values.double(), rg.SlotRows.build(slots), ok),
                     (picks.double(), pick_ok)], sink.double(), 0.125)
    ring = rg.RingKeys(values.to(device), rg.SlotRows.build(slots, device), ok.to(device),
                       codes.to(device))
    got = tri.union_attention(q.to(device), [ring, (picks.to(device), pick_ok.to(device))],
                              sink.to(device), 0.125, precision)
    err = float((got.cpu().double() - want).abs().max() / want.abs().max())
    assert err <= bound, err


def test_bad_precision_is_refused():
    with pytest.raises(ValueError, match="precision must be split or ieee"):
        tri.union_attention(torch.zeros(1, 1, D), [(torch.zeros(1, D), torch.ones(1, 1, dtype=torch.bool))],
                            torch.zeros(1), 1.0, "tf32")
