"""The decode step's row operations against their plain math.

kernels/ring_rows RingAt / put_at / take_at: a step's ring places built once, then every layer
writes and reads rows there. Checked bit for bit against plain indexing at (slot, pos % R) on
every kind of ring the engine has: contiguous (window mirror values and positions, block
store entries), a view into per-slot slabs (the state pool's rings), MXFP8 bytes seen as int64
and rows whose width or offset forbids that view; through the compiled row copy
(kernels/cpu/put_rows.c) where it is built and through torch's indexing (KVMESH_KERNELS=torch).

kernels/indexer.topk_indices: a decode row's CSA picks in one sort, element for element what
select_topk then selected_indices give."""

import pytest
import torch

from kernels.ring_rows import RingAt, put_at, take_at

S, R = 5, 7


def _places():
    # distinct (slot, pos % R) pairs, positions past the wrap and one negative (masked rows)
    slots = torch.tensor([0, 3, 3, 4, 1, 2])
    pos = torch.tensor([6, 7, 12, 30, -3, 0])
    return slots, pos


def _rings():
    g = torch.Generator().manual_seed(0)
    yield "fp32", torch.randn(S, R, 12, generator=g)
    yield "fp64 pairs", torch.randn(S, R, 2, 8, generator=g, dtype=torch.float64)
    yield "positions", torch.randint(-50, 50, (S, R), generator=g)
    yield "mxfp8 bytes", torch.randint(0, 256, (S, R, 528), generator=g, dtype=torch.uint8)
    yield "odd bytes", torch.randint(0, 256, (S, R, 12), generator=g, dtype=torch.uint8)
    # the state pool's layout: each slot's rings lie in one slab row, so a ring is strided
    slab = torch.randint(0, 256, (S, 3 * R * 528 + 16), generator=g, dtype=torch.uint8)
    yield "slab bytes", slab[:, 8 : 8 + R * 528].view(S, R, 528)
    yield "slab bytes, odd offset", slab[:, 3 : 3 + R * 528].view(S, R, 528)
    fslab = torch.randn(S, 3 * R * 16 + 4, generator=g)
    yield "slab fp32", fslab[:, 4 : 4 + R * 16].view(S, R, 2, 8)


@pytest.mark.parametrize("path", ["auto", "torch"])
@pytest.mark.parametrize("name", [n for n, _ in _rings()])
def test_put_and_take_match_plain_indexing(name, path, monkeypatch):
    if path == "torch":
        monkeypatch.setenv("KVMESH_KERNELS", "torch")
    ring = dict(_rings())[name]
    slots, pos = _places()
    at = RingAt.of(slots, pos, R)
    assert torch.equal(at.rows, pos % R) and torch.equal(at.flat, slots * R + pos % R)
    assert torch.equal(take_at(ring, at), ring[slots, pos % R])

    rows = torch.randint(0, 200, (len(slots), *ring.shape[2:])).to(ring.dtype)
    want = ring.clone()
    want[slots, pos % R] = rows
    put_at(ring, at, rows)
    assert torch.equal(ring, want)


def test_put_converts_rows_to_the_ring_dtype():
    ring = torch.zeros(S, R, 4, dtype=torch.float64)
    slots, pos = _places()
    rows = torch.randn(len(slots), 4, dtype=torch.float32)
    put_at(ring, RingAt.of(slots, pos, R), rows)
    assert torch.equal(ring[slots, pos % R], rows.double())


def test_put_leaves_every_other_row_alone():
    ring = torch.randint(0, 256, (S, R, 528), dtype=torch.uint8)
    before = ring.clone()
    slots, pos = _places()
    put_at(ring, RingAt.of(slots, pos, R), torch.zeros(len(slots), 528, dtype=torch.uint8))
    touched = torch.zeros(S, R, dtype=torch.bool)
    touched[slots, pos % R] = True
    assert torch.equal(ring[~touched], before[~touched])
    assert not ring[touched].any()


def test_compiled_put_refuses_a_place_outside_the_ring_and_writes_nothing():
    from kernels import cpu_ring
    if cpu_ring.load() is None:
        pytest.skip("no C compiler: put_at is torch's indexing")
    ring = torch.zeros(S, R, 16)
    slots, pos = _places()
    at = RingAt.of(slots, pos, R)
    bad = RingAt(at.slots.clone(), at.rows.clone(), at.flat)
    bad.slots[-1] = S                                      # one slot past the end
    with pytest.raises(IndexError, match=r"\(5, 0\) is outside \[5, 7\]"):
        put_at(ring, bad, torch.ones(len(slots), 16))
    assert not ring.any()                                  # checked before any row was copied


def test_rows_with_strided_values_take_the_torch_path():
    base = torch.zeros(S, R, 8)
    ring = base[:, :, ::2]                                  # a row's values 2 floats apart
    slots, pos = _places()
    rows = torch.randn(len(slots), 4)
    put_at(ring, RingAt.of(slots, pos, R), rows)
    assert torch.equal(base[slots, pos % R][:, ::2], rows) and not base[..., 1::2].any()


# --- kernels/indexer.topk_indices: the decode rows' CSA picks in one sort ---------------

@pytest.mark.parametrize("rows,kc,k", [(32, 80, 16), (5, 12, 16), (7, 16, 16), (3, 0, 4),
                                       (9, 40, 1)])
def test_topk_indices_is_select_then_selected_indices(rows, kc, k):
    from kernels.indexer import select_topk, selected_indices, topk_indices

    g = torch.Generator().manual_seed(rows * 100 + kc)
    for trial in range(20):
        # small integer scores: many ties, and ReLU's exact zeros
        scores = torch.randint(0, 4 if trial % 2 else 50, (rows, kc), generator=g).float()
        scores = scores.relu() * (torch.rand(rows, kc, generator=g) > 0.3)
        n_vis = torch.randint(0, kc + 1, (rows, 1), generator=g)
        visible = torch.arange(kc) < n_vis                # a prefix, as _visible_entries makes
        if trial % 3 == 0:
            visible &= torch.rand(rows, kc, generator=g) > 0.2        # any pattern too
        idx, ok = topk_indices(scores, visible, k)
        want_idx, want_ok = selected_indices(select_topk(scores, visible, k), k)
        assert torch.equal(idx, want_idx) and torch.equal(ok, want_ok), trial


# --- compressor._host_facts: a decode step's fast path = the general loop ----------------

@pytest.mark.parametrize("m", [1, 4, 16, 128])
def test_decode_feed_facts_equal_the_general_loop(m):
    """A step of one-row works (decodes) takes compressor._decode_facts; for every mix of
    positions (groups ending or not, at position 0 too) it gives _chunk_facts' answer."""
    from types import SimpleNamespace

    from services.engine.model import compressor

    g = torch.Generator().manual_seed(m)
    for _ in range(30):
        n = int(torch.randint(1, 40, (1,), generator=g))
        firsts = torch.randint(0, 3 * m + 5, (n,), generator=g).tolist()
        firsts[0] = m - 1                                  # one whose new row ends a group
        cmps = [f - int(torch.randint(0, f + 1, (1,), generator=g)) for f in firsts]
        step = SimpleNamespace(cmp_ids=tuple(cmps), slot_ids=tuple(range(5, 5 + n)))
        seg = SimpleNamespace(first_ids=tuple(firsts), counts=(1,) * n)
        for ring_len in (1, m + 3):
            want = compressor._chunk_facts(step, seg, m, ring_len)
            assert compressor._decode_facts(step, seg, m) == want
            assert compressor._host_facts(step, seg, m, ring_len) == want
