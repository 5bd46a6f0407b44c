"""Packed weight panels (kernels/cpu_gemm.py pack_weights / pack, gemm_packed_* in
kernels/cpu/gemm_body.h): the same bits as the weight as stored, a layout that is what the
docstring says, and a packed copy that follows its weight (in-place changes, its lifetime)."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels import cpu_gemm, cpu_ring

pytestmark = pytest.mark.skipif(cpu_ring.library(torch.zeros(1), (torch.float32,)) is None
                                or cpu_gemm.panel_cols(torch.float32) == 0,
                                reason="no compiled CPU library, or one without products here "
                                "(a CPU without AVX2 + FMA)")


class _Counting:
    """The library with its packed and as-stored products counted."""

    def __init__(self, lib):
        self.lib, self.packed, self.stored = lib, 0, 0

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        if not name.startswith("gemm_") or name == "gemm_panel_cols":
            return fn

        def counted(*args):
            if name.startswith("gemm_packed"):
                self.packed += 1
            else:
                self.stored += 1
            return fn(*args)
        return counted


@pytest.fixture
def counted(monkeypatch):
    box = _Counting(cpu_ring.load())
    monkeypatch.setattr(cpu_ring, "load", lambda: box)
    return box


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", [1, 2, 8, 9, 32, 33, 130])
@pytest.mark.parametrize("k,n", [(1, 5), (7, 33), (128, 1024), (128, 2), (128, 260),
                                 (300, 17), (1024, 128)])
def test_packed_equals_as_stored_bit_for_bit(dtype, m, k, n, counted):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g, dtype=dtype)
    w = torch.randn(k, n, generator=g, dtype=dtype)
    stored = cpu_gemm.matmul(x, w)
    assert (counted.stored, counted.packed) == (1, 0)
    cpu_gemm.pack_weights([w])
    was = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = cpu_gemm.matmul(x, w)
            assert torch.equal(got, stored), f"threads {threads}"
    finally:
        torch.set_num_threads(was)
    assert (counted.stored, counted.packed) == (1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_panel_layout(dtype):
    width = cpu_gemm.panel_cols(dtype)     # two vectors: 128 bytes with AVX-512, 64 with AVX2
    assert width * dtype.itemsize in (64, 128)
    assert width * dtype.itemsize == cpu_gemm.panel_cols(torch.float32) * 4
    k, n = 5, 2 * width + 3
    w = torch.arange(k * n, dtype=dtype).view(k, n)
    p = cpu_gemm.pack(w)
    assert p.shape == (3, k, width) and p.is_contiguous()
    for t in range(3):
        for c in range(width):
            col = t * width + c
            want = w[:, col] if col < n else torch.zeros(k, dtype=dtype)
            assert torch.equal(p[t, :, c], want), (t, c)


def test_an_in_place_change_repacks(counted):
    x, w = torch.randn(4, 64), torch.randn(64, 40)
    cpu_gemm.pack_weights([w])
    first = cpu_gemm.matmul(x, w)
    w.mul_(-0.5)
    after = cpu_gemm.matmul(x, w)
    assert torch.equal(after, cpu_gemm.matmul(x, w.clone()))   # an unpacked copy: as stored
    assert not torch.equal(after, first)
    assert counted.packed == 2 and counted.stored == 1


def test_nothing_is_packed_where_the_products_take_torch(monkeypatch):
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    w = torch.randn(16, 8)
    cpu_gemm.pack_weights([w])
    assert id(w) not in cpu_gemm._packed


def test_only_2d_float_cpu_tensors_are_packed():
    x = torch.randn(3, 16)
    plain, vec, ints = torch.randn(16, 8), torch.randn(16), torch.ones(16, 8, dtype=torch.int64)
    before = len(cpu_gemm._packed)
    cpu_gemm.pack_weights([vec, ints])
    assert len(cpu_gemm._packed) == before
    cpu_gemm.matmul(x, plain)
    assert id(plain) not in cpu_gemm._packed


def test_the_entry_goes_with_its_weight():
    w = torch.randn(32, 64)
    cpu_gemm.pack_weights([w])
    cpu_gemm.matmul(torch.randn(2, 32), w)
    key = id(w)
    assert cpu_gemm._packed[key] is not None
    del w
    gc.collect()
    assert key not in cpu_gemm._packed
