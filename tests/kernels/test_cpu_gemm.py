"""kernels/cpu_gemm.matmul (kernels/cpu/gemm.c) against float64 and against torch's mm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_gemm, cpu_ring

pytestmark = pytest.mark.skipif(cpu_ring.library(torch.zeros(1), (torch.float32,)) is None
                                or cpu_gemm.panel_cols(torch.float32) == 0,
                                reason="no compiled CPU library, or one without products here "
                                "(a CPU without AVX2 + FMA)")


class _Counting:
    """The library with its gemm calls counted, so a test knows the C path ran."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def gemm_f32(self, *args):
        self.calls += 1
        return self.lib.gemm_f32(*args)

    def gemm_f64(self, *args):
        self.calls += 1
        return self.lib.gemm_f64(*args)


@pytest.fixture
def counted(monkeypatch):
    box = _Counting(cpu_ring.load())
    monkeypatch.setattr(cpu_ring, "load", lambda: box)
    return box


def _ref_err(x, w, got):
    return (got.double() - x.double() @ w.double()).abs().max().item()


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 32, 33, 64, 65, 130])
@pytest.mark.parametrize("k,n", [(1, 5), (7, 33), (128, 1024), (128, 2), (128, 260),
                                 (257, 17), (1024, 128), (2048, 31)])
def test_matmul_is_as_accurate_as_torch(m, k, n, counted):
    g = torch.Generator().manual_seed(m * 10_000 + k * 10 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    got = cpu_gemm.matmul(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert counted.calls == 1                 # the C path ran
    ours, mkl = _ref_err(x, w, got), _ref_err(x, w, x @ w)
    assert ours <= 1.5 * mkl + 1e-6 * k ** 0.5, (ours, mkl)


@pytest.mark.parametrize("m", [1, 2, 9, 33])
@pytest.mark.parametrize("k,n", [(7, 5), (128, 33), (300, 17), (1024, 9)])
def test_float64_is_as_accurate_as_torch(m, k, n, counted):
    g = torch.Generator().manual_seed(m * 10_000 + k * 10 + n)
    x = torch.randn(m, k, dtype=torch.float64, generator=g)
    w = torch.randn(k, n, dtype=torch.float64, generator=g)
    got = cpu_gemm.matmul(x, w)
    assert counted.calls == 1 and got.dtype == torch.float64
    ref = x.numpy().astype(np.longdouble) @ w.numpy().astype(np.longdouble)   # 64-bit mantissa
    ours = float(np.abs(got.numpy().astype(np.longdouble) - ref).max())
    mkl = float(np.abs((x @ w).numpy().astype(np.longdouble) - ref).max())
    assert ours <= 1.5 * mkl + 1e-15 * k ** 0.5, (ours, mkl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rows_result_does_not_depend_on_its_batch_or_threads(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 1024, dtype=dtype, generator=g)
    w = torch.randn(1024, 200, dtype=dtype, generator=g)
    whole = cpu_gemm.matmul(x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_gemm.matmul(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, alone)
    for lo, hi in [(0, 1), (69, 70), (0, 2), (5, 13), (60, 70), (31, 64)]:   # one row: its own loop
        assert torch.equal(cpu_gemm.matmul(x[lo:hi], w), whole[lo:hi])


def test_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=g)
    wide = torch.randn(10, 200, generator=g)
    x = wide[:, 3:67]                       # rows 200 apart: read in place
    assert torch.equal(cpu_gemm.matmul(x, w), cpu_gemm.matmul(x.contiguous(), w))
    cols = torch.randn(64, 10, generator=g).t()     # a column-major view: copied first
    assert torch.equal(cpu_gemm.matmul(cols, w), cpu_gemm.matmul(cols.contiguous(), w))
    x3 = torch.randn(3, 5, 64, generator=g)
    assert torch.equal(cpu_gemm.matmul(x3, w), cpu_gemm.matmul(x3.reshape(15, 64), w).view(3, 5, 48))
    assert cpu_gemm.matmul(torch.randn(0, 64), w).shape == (0, 48)


def test_torch_takes_what_the_kernel_does_not(monkeypatch, counted):
    """Mixed or half dtypes, autograd and KVMESH_KERNELS=torch are torch's mm, bit for bit."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 64, generator=g)
    x16, w16 = torch.randn(4, 128, generator=g).bfloat16(), w.bfloat16()
    assert torch.equal(cpu_gemm.matmul(x16, w16), x16 @ w16)
    with pytest.raises(RuntimeError):
        cpu_gemm.matmul(x16.double(), w)           # torch's own dtype error
    wg = w.clone().requires_grad_(True)
    x = torch.randn(4, 128, generator=g)
    out = cpu_gemm.matmul(x, wg)
    out.sum().backward()
    assert torch.equal(wg.grad, x.sum(0, keepdim=True).t().expand(128, 64))
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    assert torch.equal(cpu_gemm.matmul(x, w), x @ w)
    assert counted.calls == 0
    monkeypatch.delenv("KVMESH_KERNELS")
    cpu_gemm.matmul(x, w)
    assert counted.calls == 1
