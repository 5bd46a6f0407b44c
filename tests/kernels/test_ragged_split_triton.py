"""The Triton ragged attention split over keys (kernels/triton/ragged.py `parts`): a step of
few rows cuts each row's keys into parts, one program per part, and combines the parts'
softmax states by their log-sum-exp. Against the torch ragged op (the reference), fp32,
error <= 1e-3 of the output's largest magnitude, as tests/kernels/test_ragged_triton.py:
a batch-1 decode over a ring that wraps, with CSA picks and sinks from none to dominant,
the window truncated at every offset (parts that see nothing), an empty compressed set,
a shared pool with HCA entries; and which grids are split (`key_parts`)."""

import pytest
import torch

from kernels import mxfp8
from kernels import ragged as rg
from kernels.triton import ragged as tri
from tests.kernels.test_ragged_triton import _both, _close, shared_pool

D, H = 64, 3
W, R = 48, 54            # a ring of R rows holding a window of W: 3 or 4 tiles of 16 keys


def _ring_rows(works, slots_total):
    """works: (slot, position, lo) of decode rows -> ring values, codes, slots, ok."""
    g = torch.Generator().manual_seed(len(works))
    codes = mxfp8.quantize_torch(torch.randn(slots_total, R, D, generator=g) * 3)
    slots, oks = [], []
    for slot, p, lo in works:
        held = p - torch.remainder(p - torch.arange(R), R)        # ring row r holds x(r)
        slots.append(slot)
        oks.append((held >= max(lo, p - W + 1, 0)) & (held <= p))
    return mxfp8.dequantize_torch(codes), codes, slots, torch.stack(oks)


@pytest.mark.parametrize("parts", [2, 3, 5])
@pytest.mark.parametrize("mx", [False, True], ids=["mirror", "mxfp8"])
def test_batch1_decode_with_picks_split_over_keys(device, parts, mx):
    g = torch.Generator().manual_seed(parts)
    values, codes, slots, ok = _ring_rows([(2, 130, 0)], 4)       # position 130: wrapped
    q = torch.randn(1, H, D, generator=g)
    sink = torch.tensor([0.0, 1.5, 30.0])                         # the last head: sink only
    picks = torch.randn(1, 40, D, generator=g) * 3                # 40 CSA picks, 3 tiles
    pick_ok = torch.rand(1, 40, generator=g) > 0.3
    ring = rg.RingKeys(values, rg.SlotRows.build(slots), ok, codes if mx else None)
    got, want = _both(q, [ring, (picks, pick_ok)], sink, device, parts=parts)
    _close(got, want)
    whole, _ = _both(q, [ring, (picks, pick_ok)], sink, device, parts=1)
    _close(got, whole)


def test_window_truncated_at_every_offset_split_over_keys(device):
    # one decode row per lower bound, from below the window to past the row: the first
    # parts of a row see nothing once lo passes them, the last row sees only its sink
    p = 100
    works = [(s, p, lo) for s, lo in enumerate([*range(p - W - 1, p + 1, 3), p + 1])]
    values, codes, slots, ok = _ring_rows(works, len(works))
    g = torch.Generator().manual_seed(9)
    q = torch.randn(len(works), H, D, generator=g)
    sink = torch.randn(H, generator=g)
    ring = rg.RingKeys(values, rg.SlotRows.build(slots), ok, codes)
    empty = (torch.zeros(len(works), 0, D), torch.zeros(len(works), 0, dtype=torch.bool))
    got, want = _both(q, [ring, empty], sink, device, parts=4)
    _close(got, want)
    assert not bool(ok[-1].any()) and torch.all(got[-1].cpu() == 0)


def test_shared_pool_with_hca_entries_split_over_keys(device):
    g = torch.Generator().manual_seed(11)
    t = 3
    pool, ok = shared_pool(g, t, W, D, lo=-20)
    entries = torch.randn(37, D, generator=g) * 3
    vis = torch.arange(37).unsqueeze(0) < torch.tensor([0, 20, 37]).unsqueeze(1)
    q = torch.randn(t, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    got, want = _both(q, [(pool, ok), (entries, vis)], sink, device, parts=3)
    _close(got, want)


def test_only_small_grids_are_split(device):
    # a batch-1 decode of 64 heads (4 programs) over a ring and 512 picks: at least MIN_PART
    # keys a part, the grid filled up to FILL programs, at most MAX_PARTS
    assert tri.key_parts(1, 64, 134 + 512) == (134 + 512) // tri.MIN_PART
    assert tri.key_parts(1, 64, tri.MIN_PART - 1) == 1                # too few keys
    assert tri.key_parts(128, 64, 134 + 512) == 1                     # grid full already
    assert 1 < tri.key_parts(8, 64, 4096) <= tri.MAX_PARTS
    g = torch.Generator().manual_seed(12)
    values, codes, slots, ok = _ring_rows([(0, 70, 0)], 1)
    picks = torch.randn(1, 200, D, generator=g) * 3
    pick_ok = torch.ones(1, 200, dtype=torch.bool)
    q = torch.randn(1, H, D, generator=g)
    sink = torch.randn(H, generator=g)
    assert tri.key_parts(1, H, 200) == 3                              # the default splits here
    got, want = _both(q, [rg.RingKeys(values, rg.SlotRows.build(slots), ok, codes),
                          (picks, pick_ok)], sink, device)
    _close(got, want)
    with pytest.raises(ValueError, match="parts must be >= 1"):
        _both(q, [(picks[0], pick_ok)], sink, device, parts=0)
