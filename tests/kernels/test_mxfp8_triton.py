"""Triton MXFP8 quantize / dequantize: bytes bit-identical to the torch reference."""

import pytest
import torch

from kvmesh.kernels import mxfp8
from kvmesh.kernels.triton import mxfp8 as tri


def _e4m3_grid():
    """Every finite non-negative E4M3 value, ascending."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn).float()


def _cases() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(24, 512, generator=g)
            * torch.exp(torch.randn(24, 16, 1, generator=g) * 12).repeat(1, 1, 32).view(24, 512)]
    grid = _e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2                     # exact ties: round half to even
    special = torch.zeros(4, 512)
    # block 0: amax exactly 448 (scale 2**0), the first 31 midpoints; block 1: the next ones
    special[0, :32] = torch.cat([torch.tensor([448.0]), mids[:31]])
    special[0, 32:64] = torch.cat([torch.tensor([-448.0]), -mids[31:62]])
    special[0, 64:96] = torch.cat([torch.tensor([448.0]), mids[62:93]])
    special[0, 96:128] = torch.cat([torch.tensor([448.0]), mids[93:124]])
    # amax just above 448 * 2**k: the scale must step up (log2 rounding would not)
    for b, k in enumerate(range(-60, 60, 8)):
        top = torch.nextafter(torch.tensor(448.0 * 2.0**k), torch.tensor(float("inf")))
        special[1, b * 32] = top
        special[1, b * 32 + 1 : b * 32 + 32] = top * torch.linspace(-1, 1, 31)
    # zeros, negative zeros, fp32 subnormals, the clamped smallest scale, huge values
    special[2, 32:64] = -0.0
    special[2, 64:96] = torch.tensor(1e-42) * torch.arange(32)
    special[2, 96:128] = 2.0**-121 * torch.linspace(-1, 1, 32)
    special[2, 128:160] = 3e38 * torch.linspace(-1, 1, 32)
    special[3] = 2.0**-128 * torch.randn(512, generator=g)
    return torch.cat(rows + [special])


def test_quantize_bytes_match_the_reference(device):
    x = _cases()
    want = mxfp8.quantize_torch(x)
    got = tri.quantize(x.to(device)).cpu()
    assert got.shape == (x.shape[0], 528) and got.dtype == torch.uint8
    diff = torch.nonzero(got != want)
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at {diff[:4].tolist()}"


def test_reference_scale_is_exact_rceil():
    x = _cases()
    q = mxfp8.quantize_torch(x)
    amax = x.view(x.shape[0], 16, 32).abs().amax(-1).double()
    scale = torch.exp2(q[:, 512:].double() - 127)
    inside = (amax > 2.0**-100) & (amax < 2.0**120)
    assert torch.all((amax <= 448 * scale)[inside])                 # no value saturates
    assert torch.all((amax > 224 * scale)[inside])                  # and the scale is the smallest


def test_quantize_writes_ring_rows_in_place(device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 128, generator=g)
    ring = torch.full((7, 132), 0xAB, dtype=torch.uint8, device=device)
    rows = torch.tensor([5, 0, 3], device=device)
    tri.quantize(x.to(device), out=ring, rows=rows)
    ring = ring.cpu()
    assert torch.equal(ring[[5, 0, 3]], mxfp8.quantize_torch(x))
    assert torch.all(ring[[1, 2, 4, 6]] == 0xAB)                     # other rows untouched


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # 448 * 2**127 = inf
def test_dequantize_every_code_and_scale(device):
    codes = torch.arange(256, dtype=torch.uint8).view(1, 256).repeat(1, 2)   # 512 values
    scales = torch.tensor([[0, 1, 60, 100, 119, 120, 126, 127, 128, 130, 140, 200, 250, 252, 253, 254]],
                          dtype=torch.uint8)
    q = torch.cat([codes, scales], dim=1)
    q = torch.cat([q, mxfp8.quantize_torch(_cases())])
    want = mxfp8.dequantize_torch(q)
    got = tri.dequantize(q.to(device)).cpu()
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(got[ok].signbit(), want[ok].signbit())


def test_dispatch_routes_mxfp8(monkeypatch, device):
    x = _cases()[:5].to(device)
    calls = []
    real = tri.quantize
    monkeypatch.setattr(tri, "quantize", lambda t: calls.append(1) or real(t))
    monkeypatch.setenv("KVMESH_KERNELS", "triton")
    got = mxfp8.quantize(x).cpu()
    assert calls == [1] and torch.equal(got, mxfp8.quantize_torch(x.cpu()))
    monkeypatch.setenv("KVMESH_KERNELS", "torch")
    mxfp8.quantize(x)
    assert calls == [1]
