"""Whole-row ring copies in C (kernels/cpu_rows.py): the same bytes as torch's indexing, for
contiguous rings, strided ones (the state pool's rings are views into per-slot slabs) and flat
tables; a bad index raises and moves nothing; off the CPU path they step aside."""

import pytest
import torch

from kernels import cpu_ring, cpu_rows, ragged

pytestmark = pytest.mark.skipif(cpu_ring._compiler() is None,
                                reason="no C compiler: ragged.put_at / take_at use torch ops")


@pytest.fixture(autouse=True)
def small_copies_too(monkeypatch):
    """These rings are small: every copy takes the C path unless a test says otherwise (put
    returning True / take returning a tensor is that path having run)."""
    monkeypatch.setattr(cpu_rows, "MIN_ROWS", 0)
    monkeypatch.setattr(cpu_rows, "MIN_BYTES", 0)


def _slab_ring(dtype):
    """A [S, R, 2, 8] ring that is a view into per-slot slabs (slot stride > R * row)."""
    slab = torch.arange(6 * 40 * 16).to(dtype).view(6, 40, 16)
    return slab[:, 3:13].view(6, 10, 2, 8)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.int64, torch.float64])
@pytest.mark.parametrize("strided", [False, True])
def test_put_and_take_equal_torch_indexing(dtype, strided):
    ring = _slab_ring(dtype) if strided else torch.arange(6 * 10 * 16).to(dtype).view(6, 10, 2, 8)
    assert ring.is_contiguous() != strided
    slots, rows = torch.tensor([4, 0, 5, 4, 2]), torch.tensor([9, 0, 3, 2, 9])
    src = (torch.arange(5 * 16) * 3 % 251).to(dtype).view(5, 2, 8)
    want = ring.clone()
    want[slots, rows] = src
    before = ring.clone()
    assert cpu_rows.put(ring, slots, rows, src)
    assert torch.equal(ring, want)
    assert torch.equal(ring[slots, rows], src)
    untouched = torch.ones(6, 10, dtype=torch.bool)
    untouched[slots, rows] = False
    assert torch.equal(ring[untouched], before[untouched])
    got = cpu_rows.take(ring, torch.tensor([5, 1, 1]), torch.tensor([3, 7, 0]))
    assert torch.equal(got, ring[torch.tensor([5, 1, 1]), torch.tensor([3, 7, 0])])


def test_flat_table_take_keeps_the_index_shape():
    table = torch.randn(30, 32)
    idx = torch.randint(0, 30, (4, 7))
    got = cpu_rows.take(table, idx, None, tuple(idx.shape))
    assert got.shape == (4, 7, 32) and torch.equal(got, table[idx])
    assert torch.equal(ragged.take_rows(table, idx), table[idx])


def test_ragged_ring_helpers_take_the_c_path_and_match():
    ring = _slab_ring(torch.float32)
    at = ragged.RingAt.of(torch.tensor([1, 3]), torch.tensor([12, 25]), 10)
    rows = torch.randn(2, 2, 8)
    ragged.put_at(ring, at, rows)
    assert torch.equal(ring[torch.tensor([1, 3]), torch.tensor([2, 5])], rows)
    assert torch.equal(ragged.take_at(ring, at), rows)


@pytest.mark.parametrize("bad", [(6, 0), (-1, 0), (0, 10), (0, -1)])
def test_an_index_out_of_bounds_raises_and_moves_nothing(bad):
    ring = torch.zeros(6, 10, 16)
    before = ring.clone()
    slots, rows = torch.tensor([1, bad[0]]), torch.tensor([1, bad[1]])
    with pytest.raises(IndexError):
        cpu_rows.put(ring, slots, rows, torch.ones(2, 16))
    assert torch.equal(ring, before)                  # the good first row was not written either
    with pytest.raises(IndexError):
        cpu_rows.take(ring, slots, rows)
    with pytest.raises(IndexError):
        cpu_rows.take(ring.view(60, 16), torch.tensor([0, 60]), None)


def test_a_source_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="cannot take"):
        cpu_rows.put(torch.zeros(4, 5, 8), torch.tensor([0, 1]), torch.tensor([0, 1]), torch.ones(3, 8))


def test_steps_aside_where_torch_must_do_it(monkeypatch):
    ring = torch.zeros(4, 5, 8)
    # a dtype mismatch, rows that are not contiguous bytes, autograd: the caller's torch op
    assert not cpu_rows.put(ring, torch.tensor([0]), torch.tensor([0]), torch.ones(1, 8, dtype=torch.float64))
    assert cpu_rows.take(torch.zeros(4, 5, 8)[..., ::2], torch.tensor([0]), torch.tensor([0])) is None
    assert cpu_rows.take(torch.zeros(4, 8, requires_grad=True), torch.tensor([0]), None) is None
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    assert not cpu_rows.put(ring, torch.tensor([0]), torch.tensor([0]), torch.ones(1, 8))
    assert cpu_rows.take(ring, torch.tensor([0]), torch.tensor([0])) is None
    at = ragged.RingAt.of(torch.tensor([2]), torch.tensor([7]), 5)
    ragged.put_at(ring, at, torch.full((1, 8), 3.0))     # the torch op, same result
    assert torch.equal(ring[2, 2], torch.full((8,), 3.0))


def test_small_copies_stay_with_torch(monkeypatch):
    """Under MIN_ROWS rows or MIN_BYTES bytes the torch op is the cheaper call: steps aside."""
    monkeypatch.setattr(cpu_rows, "MIN_ROWS", 8)
    monkeypatch.setattr(cpu_rows, "MIN_BYTES", 8192)
    ring = torch.zeros(64, 10, 512)
    few, many = torch.arange(4), torch.arange(32)
    assert not cpu_rows.put(ring, few, few % 10, torch.ones(4, 512))
    assert cpu_rows.put(ring, many, many % 10, torch.ones(32, 512))          # 64 KB
    pos = torch.zeros(64, 10, dtype=torch.long)
    assert not cpu_rows.put(pos, many, many % 10, many)                       # 256 B
    assert cpu_rows.take(ring, few, few % 10) is None
    assert torch.equal(cpu_rows.take(ring, many, many % 10), torch.ones(32, 512))
